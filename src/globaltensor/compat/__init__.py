"""What differs between the supported torch releases, found by feature detection, never by version
checks: ``aten`` names tolerant of ops a release lacks (torch_ops.py), storage use counts
(storage.py)."""
