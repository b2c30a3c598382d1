"""Stand-in for fla.ops: see fla/__init__.py."""
