"""The HTTP server: Litestar app factory, routes by concern, errors, auth, metrics."""
