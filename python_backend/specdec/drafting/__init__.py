"""Drafters: one per file. Each proposes a chain or a tree of draft tokens for the target to verify."""
