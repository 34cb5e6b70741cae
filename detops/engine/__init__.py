"""Training, checkpointing, COCO evaluation and pictures."""
from .checkpoint import Checkpointer, load_model_state
from .evaluator import evaluate, format_table
from .lr_scheduler import WarmupMultiStepLR, make_lr_scheduler, make_optimizer
from .trainer import do_train
from .visualize import draw_detections, plot_loss_curve

__all__ = ["Checkpointer", "WarmupMultiStepLR", "do_train", "draw_detections", "evaluate", "format_table",
           "load_model_state", "make_lr_scheduler", "make_optimizer", "plot_loss_curve"]
