"""Where in the user's program something happens: the innermost frame outside torch and globaltensor."""
from __future__ import annotations

import os
import traceback

import torch

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


def user_frame() -> str:
    """``file:line, in function: "source"`` of the innermost frame of the calling program."""
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        # the library's inlined wrappers have files of their own: "<globaltensor: ...>" (compat/dynamo.py)
        if not path.startswith((_PACKAGE_DIR, _TORCH_DIR)) and "<frozen" not in path and \
                not frame.filename.startswith("<globaltensor"):
            return f'{frame.filename}:{frame.lineno}, in {frame.name}: "{(frame.line or "").strip()}"'
    return "an unknown place"
