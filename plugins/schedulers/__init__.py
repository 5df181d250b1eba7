"""Built-in schedulers: fcfs and priority."""
