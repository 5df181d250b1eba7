"""tierserve fleet: engine replicas as a Ray Serve application behind one ingress, with cache-aware routing."""
