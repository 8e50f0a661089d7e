"""Keeping what an op writes: in-place and out= ops on their own pieces or written back
(inplace.py), metadata in-place ops (inplace_view.py), and writes into views whose pieces are
copies put back into their bases (viewwrite.py)."""
