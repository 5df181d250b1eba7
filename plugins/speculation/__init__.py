"""Built-in speculators: ngram (prompt lookup) and draft_model."""
