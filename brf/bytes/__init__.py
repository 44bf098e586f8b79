"""brf.bytes: every member as a model over bytes, exactly or with a reported pruned mass."""
