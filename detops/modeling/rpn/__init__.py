from .anchor_generator import AnchorGenerator
from .rpn import RPNModule, build_rpn

__all__ = ["AnchorGenerator", "RPNModule", "build_rpn"]
