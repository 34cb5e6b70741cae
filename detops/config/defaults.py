"""Default configuration of the detector, with maskrcnn-benchmark's key names.

Every key a YAML file or an override list may set is declared here; yacs rejects any other key
(``KeyError: 'Non-existent config key: MODEL.RPN.NMS_THRESHOLD'``), so a typo never passes
silently. Box coordinates follow torchvision's convention (x2 - x1 is the width, no "+ 1").
"""
try:
    from yacs.config import CfgNode as CN
except ImportError as e:  # pragma: no cover
    raise ImportError("detops.config (and detops.modeling) need yacs: pip install yacs") from e

_C = CN()

_C.MODEL = CN()
_C.MODEL.META_ARCHITECTURE = "GeneralizedRCNN"
_C.MODEL.RPN_ONLY = False
_C.MODEL.MASK_ON = False
_C.MODEL.DEVICE = "cpu"
# Path of a checkpoint (a detops state_dict) loaded by build_detection_model; "" for none.
_C.MODEL.WEIGHT = ""
# Memory format of the convolutions' weights and activations: "contiguous" (default),
# "channels_last" or "auto" (channels_last on CUDA, contiguous elsewhere). On CUDA, channels_last
# needs no cuDNN layout transposes and detops' RoIAlign reads channels_last features directly
# (training runs faster), but its detections differ from torchvision's by more
# than the parity tests' tolerances (scores beyond 1e-4), so it is opt-in. On CPU it gives the
# same detections.
_C.MODEL.MEMORY_FORMAT = "contiguous"
# CUDA graphs of the training work that needs no gradients (detops.modeling.cuda_graph.
# GraphedFunction): in the RPN the proposals (decoding, top-n, NMS, padding) with the anchors'
# targets (matching, sampling, encoding), and in the box head the sampling of its RoIs. Both run
# in fixed shapes (the gt padded to a multiple of 8 per image), so after
# TARGETS_CUDA_GRAPH_AFTER consecutive iterations with one shape they are captured and then
# replayed as one launch each. TARGETS_CUDA_GRAPHS is the number of shapes each keeps graphs
# for; 0 turns them off. The samplers draw the same random numbers as in eager mode.
_C.MODEL.TARGETS_CUDA_GRAPHS = 2
_C.MODEL.TARGETS_CUDA_GRAPH_AFTER = 3

# ---------------------------------------------------------------------------- #
# Backbone
# ---------------------------------------------------------------------------- #
_C.MODEL.BACKBONE = CN()
# "R-<depth>-FPN" (depth 18, 34, 50, 101) or "R-<depth>-C4"-style bodies registered later.
_C.MODEL.BACKBONE.CONV_BODY = "R-50-FPN"
# Stages up to and including this one are frozen: 0 none, 1 the stem, 2 stem + res2, ...
_C.MODEL.BACKBONE.FREEZE_CONV_BODY_AT = 2
# CUDA graphs of the backbone's training forward and backward (detops.modeling.cuda_graph):
# after CUDA_GRAPH_AFTER consecutive training iterations with one padded input shape, that
# shape's forward and backward are captured and replayed as one launch each, which frees the
# host to issue the heads' work while the GPU runs the backbone. Losses and gradients are
# bitwise those of eager mode. CUDA_GRAPHS is the number of input shapes given graphs (each
# keeps its activations in its own memory pool); 0 turns them off. Other shapes, inference,
# autocast, module hooks and BatchNorm with running statistics run eagerly.
_C.MODEL.BACKBONE.CUDA_GRAPHS = 1
_C.MODEL.BACKBONE.CUDA_GRAPH_AFTER = 3

_C.MODEL.RESNETS = CN()
_C.MODEL.RESNETS.NUM_GROUPS = 1
_C.MODEL.RESNETS.WIDTH_PER_GROUP = 64
# maskrcnn-benchmark's MSRA weights stride in the 1x1 conv; torchvision's in the 3x3 conv.
_C.MODEL.RESNETS.STRIDE_IN_1X1 = False
_C.MODEL.RESNETS.STEM_OUT_CHANNELS = 64
_C.MODEL.RESNETS.RES2_OUT_CHANNELS = 256
# FrozenBatchNorm2d epsilon (torchvision: 1e-5; maskrcnn-benchmark's MSRA weights: 0).
_C.MODEL.RESNETS.BN_EPS = 1e-5
# Normalisation layers of the ResNet body: "FrozenBN" (pretrained weights), "BN" (trainable
# BatchNorm2d) or "GN" (GroupNorm, 32 groups). A body trained from random initialisation needs
# "BN" or "GN" (and BACKBONE.FREEZE_CONV_BODY_AT: 0).
_C.MODEL.RESNETS.NORM = "FrozenBN"

_C.MODEL.FPN = CN()
_C.MODEL.FPN.OUT_CHANNELS = 256
# The extra P6 level, max-pooled from P5 (kernel 1, stride 2).
_C.MODEL.FPN.USE_MAX_POOL_LEVEL = True

# ---------------------------------------------------------------------------- #
# RPN
# ---------------------------------------------------------------------------- #
_C.MODEL.RPN = CN()
_C.MODEL.RPN.NAME = "SingleConvRPNHead"
# One size per FPN level (P2..P6)
_C.MODEL.RPN.ANCHOR_SIZES = (32, 64, 128, 256, 512)
_C.MODEL.RPN.ANCHOR_STRIDE = (4, 8, 16, 32, 64)
# True: each level's stride is (padded batch size) // (feature size), as torchvision computes it
# (what its weights expect; it differs from ANCHOR_STRIDE at P6 when the size is not a
# multiple of 64). False: ANCHOR_STRIDE.
_C.MODEL.RPN.INFER_ANCHOR_STRIDE = True
_C.MODEL.RPN.ASPECT_RATIOS = (0.5, 1.0, 2.0)
_C.MODEL.RPN.FG_IOU_THRESHOLD = 0.7
_C.MODEL.RPN.BG_IOU_THRESHOLD = 0.3
_C.MODEL.RPN.BATCH_SIZE_PER_IMAGE = 256
_C.MODEL.RPN.POSITIVE_FRACTION = 0.5
# Top-n proposals of each FPN level kept before NMS
_C.MODEL.RPN.PRE_NMS_TOP_N_TRAIN = 2000
_C.MODEL.RPN.PRE_NMS_TOP_N_TEST = 1000
# Proposals of each image kept after NMS (non-FPN bodies)
_C.MODEL.RPN.POST_NMS_TOP_N_TRAIN = 2000
_C.MODEL.RPN.POST_NMS_TOP_N_TEST = 1000
# Proposals of each image kept after NMS over all FPN levels
_C.MODEL.RPN.FPN_POST_NMS_TOP_N_TRAIN = 2000
_C.MODEL.RPN.FPN_POST_NMS_TOP_N_TEST = 1000
_C.MODEL.RPN.NMS_THRESH = 0.7
# Proposals smaller than this (width or height, input-image pixels) are removed
_C.MODEL.RPN.MIN_SIZE = 1e-3
# Proposals whose objectness probability is below this are removed
_C.MODEL.RPN.SCORE_THRESH = 0.0
_C.MODEL.RPN.BBOX_REG_WEIGHTS = (1.0, 1.0, 1.0, 1.0)

# ---------------------------------------------------------------------------- #
# RoI heads
# ---------------------------------------------------------------------------- #
_C.MODEL.ROI_HEADS = CN()
_C.MODEL.ROI_HEADS.FG_IOU_THRESHOLD = 0.5
_C.MODEL.ROI_HEADS.BG_IOU_THRESHOLD = 0.5
_C.MODEL.ROI_HEADS.BBOX_REG_WEIGHTS = (10.0, 10.0, 5.0, 5.0)
_C.MODEL.ROI_HEADS.BATCH_SIZE_PER_IMAGE = 512
_C.MODEL.ROI_HEADS.POSITIVE_FRACTION = 0.25
_C.MODEL.ROI_HEADS.SCORE_THRESH = 0.05
_C.MODEL.ROI_HEADS.NMS = 0.5
_C.MODEL.ROI_HEADS.DETECTIONS_PER_IMG = 100
# Detections whose width or height is below this are removed
_C.MODEL.ROI_HEADS.MIN_SIZE = 1e-2

_C.MODEL.ROI_BOX_HEAD = CN()
_C.MODEL.ROI_BOX_HEAD.FEATURE_EXTRACTOR = "FPN2MLPFeatureExtractor"
_C.MODEL.ROI_BOX_HEAD.PREDICTOR = "FPNPredictor"
_C.MODEL.ROI_BOX_HEAD.POOLER_RESOLUTION = 7
_C.MODEL.ROI_BOX_HEAD.POOLER_SAMPLING_RATIO = 2
# Scales of the pooled levels (P2..P5); informative, detops infers them from the feature maps
_C.MODEL.ROI_BOX_HEAD.POOLER_SCALES = (0.25, 0.125, 0.0625, 0.03125)
_C.MODEL.ROI_BOX_HEAD.MLP_HEAD_DIM = 1024
_C.MODEL.ROI_BOX_HEAD.NUM_CLASSES = 91

_C.MODEL.ROI_MASK_HEAD = CN()
_C.MODEL.ROI_MASK_HEAD.FEATURE_EXTRACTOR = "MaskRCNNFPNFeatureExtractor"
_C.MODEL.ROI_MASK_HEAD.PREDICTOR = "MaskRCNNC4Predictor"
_C.MODEL.ROI_MASK_HEAD.POOLER_RESOLUTION = 14
_C.MODEL.ROI_MASK_HEAD.POOLER_SAMPLING_RATIO = 2
_C.MODEL.ROI_MASK_HEAD.POOLER_SCALES = (0.25, 0.125, 0.0625, 0.03125)
_C.MODEL.ROI_MASK_HEAD.CONV_LAYERS = (256, 256, 256, 256)
_C.MODEL.ROI_MASK_HEAD.DILATION = 1
_C.MODEL.ROI_MASK_HEAD.RESOLUTION = 28
# Pasted masks are thresholded at this value when > 0; torchvision (and the default) return
# probabilities (-1 keeps them).
_C.MODEL.ROI_MASK_HEAD.POSTPROCESS_MASKS_THRESHOLD = -1.0

# ---------------------------------------------------------------------------- #
# Input
# ---------------------------------------------------------------------------- #
_C.INPUT = CN()
# Shorter side of training images, one chosen at random per image
_C.INPUT.MIN_SIZE_TRAIN = (800,)
_C.INPUT.MAX_SIZE_TRAIN = 1333
_C.INPUT.MIN_SIZE_TEST = 800
_C.INPUT.MAX_SIZE_TEST = 1333
# Applied by the model to [0, 1] RGB images: (x - mean) / std; with TO_BGR255 the image is
# first turned into BGR 0..255 (Caffe2 weights) and mean/std are in that space.
_C.INPUT.PIXEL_MEAN = [0.485, 0.456, 0.406]
_C.INPUT.PIXEL_STD = [0.229, 0.224, 0.225]
_C.INPUT.TO_BGR255 = False

_C.DATASETS = CN()
# Dataset names (see detops.data.catalog): "shapes_train" / "shapes_val" (synthetic, built in),
# a name registered in COCO_ROOTS, or a standard COCO name ("coco_2017_train", ...) under DATA_DIR.
_C.DATASETS.TRAIN = ()
_C.DATASETS.TEST = ()
# Root of the standard COCO names: DATA_DIR/coco/{train2017,val2017,annotations/...}
_C.DATASETS.DATA_DIR = "datasets"
# Extra COCO-format datasets: a list of (name, image folder, annotation JSON) triples, e.g.
# [["my_train", "data/imgs", "data/train.json"]]. Relative paths are taken from DATA_DIR's parent
# (the working directory).
_C.DATASETS.COCO_ROOTS = []
# The synthetic shapes dataset (circles, squares, triangles on textured backgrounds)
_C.DATASETS.SHAPES = CN()
_C.DATASETS.SHAPES.IMAGE_SIZE = 160
_C.DATASETS.SHAPES.NUM_TRAIN = 1000
_C.DATASETS.SHAPES.NUM_VAL = 100
_C.DATASETS.SHAPES.SEED = 0
_C.DATASETS.SHAPES.MIN_OBJECTS = 1
_C.DATASETS.SHAPES.MAX_OBJECTS = 4
# Object size (side / diameter) in pixels
_C.DATASETS.SHAPES.MIN_OBJ_SIZE = 15
_C.DATASETS.SHAPES.MAX_OBJ_SIZE = 60

_C.DATALOADER = CN()
_C.DATALOADER.NUM_WORKERS = 2
_C.DATALOADER.SIZE_DIVISIBILITY = 32
_C.DATALOADER.ASPECT_RATIO_GROUPING = True
# Probability of a horizontal flip of each training image
_C.DATALOADER.HFLIP_PROB = 0.5

# ---------------------------------------------------------------------------- #
# Solver
# ---------------------------------------------------------------------------- #
_C.SOLVER = CN()
_C.SOLVER.MAX_ITER = 40000
_C.SOLVER.BASE_LR = 0.02
_C.SOLVER.BIAS_LR_FACTOR = 2
_C.SOLVER.MOMENTUM = 0.9
_C.SOLVER.WEIGHT_DECAY = 0.0001
_C.SOLVER.WEIGHT_DECAY_BIAS = 0.0
_C.SOLVER.GAMMA = 0.1
_C.SOLVER.STEPS = (30000,)
_C.SOLVER.WARMUP_FACTOR = 1.0 / 3
_C.SOLVER.WARMUP_ITERS = 500
_C.SOLVER.WARMUP_METHOD = "linear"
_C.SOLVER.CHECKPOINT_PERIOD = 2500
_C.SOLVER.IMS_PER_BATCH = 16
# Gradient clipping by total norm; 0 turns it off
_C.SOLVER.CLIP_GRAD_NORM = 0.0
# Mixed precision (torch.autocast + GradScaler); used only on CUDA
_C.SOLVER.AMP = False
# A progress line every LOG_PERIOD iterations
_C.SOLVER.LOG_PERIOD = 20

_C.TEST = CN()
_C.TEST.EXPECTED_RESULTS = []
_C.TEST.EXPECTED_RESULTS_SIGMA_TOL = 4
_C.TEST.IMS_PER_BATCH = 8
_C.TEST.DETECTIONS_PER_IMG = 100

# Evaluation: number of images drawn into OUTPUT_DIR/visualization after the final evaluation,
# and the score a detection needs to be drawn
_C.TEST.VIS_IMAGES = 6
_C.TEST.VIS_SCORE_THRESH = 0.5

# Seed of the model initialisation, the data order and the augmentations
_C.SEED = 0
_C.OUTPUT_DIR = "."
