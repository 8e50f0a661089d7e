"""Keeping what an op writes: in-place and out= ops on their own pieces or written back
(written_inputs.py), metadata in-place ops (metadata_ops.py), and writes into views whose pieces are
copies put back into their bases (copy_views.py)."""
