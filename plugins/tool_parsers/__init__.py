"""Built-in tool-call formats (``register_tool_parsers``)."""
