"""Parts of the detector on CPU: config, registry, structures, anchors, box coder, matcher,
sampler, pooler, post-processing helpers."""
import pytest
import torch
import torchvision

from detops.config import get_cfg
from detops.modeling.balanced_positive_negative_sampler import BalancedPositiveNegativeSampler
from detops.modeling.box_coder import BoxCoder
from detops.modeling.matcher import Matcher
from detops.modeling.registry import BACKBONES, Registry
from detops.modeling.roi_heads.mask_head.inference import paste_masks_in_image
from detops.modeling.rpn.anchor_generator import AnchorGenerator, generate_cell_anchors
from detops.modeling.utils import top_k_per_group
from detops.structures import BoxList, ImageList, boxlist_iou, cat_boxlist, to_image_list


def test_config_unknown_key_is_rejected(tmp_path):
    cfg = get_cfg()
    with pytest.raises((KeyError, AssertionError), match="Non-existent.*MODEL.RPN.NMS_THRESHOLD"):
        cfg.merge_from_list(["MODEL.RPN.NMS_THRESHOLD", 0.5])
    bad = tmp_path / "bad.yaml"
    bad.write_text("MODEL:\n  RPN:\n    NMS_THRESHOLD: 0.5\n")
    with pytest.raises(KeyError, match="Non-existent config key: MODEL.RPN.NMS_THRESHOLD"):
        cfg.merge_from_file(str(bad))
    cfg.merge_from_list(["MODEL.RPN.NMS_THRESH", 0.6])
    assert cfg.MODEL.RPN.NMS_THRESH == 0.6
    assert get_cfg().MODEL.RPN.NMS_THRESH == 0.7  # get_cfg returns a copy


def test_registry_unknown_name_lists_known_names():
    reg = Registry("THINGS")

    @reg.register("A")
    class A:
        pass

    assert reg["A"] is A
    with pytest.raises(KeyError, match=r"THINGS: unknown name 'B'; registered names are: A"):
        reg["B"]
    with pytest.raises(KeyError, match="already registered"):
        reg.register("A", A)
    with pytest.raises(KeyError, match="R-50-FPN"):
        BACKBONES["R-51-FPN"]


def test_boxlist_resize_clip_convert_and_fields():
    b = BoxList(torch.tensor([[0.0, 0.0, 10.0, 20.0], [5.0, 5.0, 30.0, 40.0]]), (20, 30))
    b.add_field("labels", torch.tensor([1, 2]))
    r = b.resize((40, 60))
    assert torch.equal(r.bbox, torch.tensor([[0.0, 0.0, 20.0, 40.0], [10.0, 10.0, 60.0, 80.0]]))
    c = b.clip_to_image()
    assert torch.equal(c.bbox[1], torch.tensor([5.0, 5.0, 20.0, 30.0]))
    w = b.convert("xywh")
    assert torch.equal(w.bbox[1], torch.tensor([5.0, 5.0, 25.0, 35.0]))
    assert torch.equal(w.convert("xyxy").bbox, b.bbox)
    assert torch.equal(b[torch.tensor([1])].get_field("labels"), torch.tensor([2]))
    assert len(cat_boxlist([b, b])) == 4
    iou = boxlist_iou(b, b)
    assert torch.allclose(iou.diag(), torch.ones(2))
    with pytest.raises(ValueError, match=r"\[N, 4\]"):
        BoxList(torch.zeros(3, 5), (10, 10))


def test_image_list_size_divisibility():
    il = to_image_list([torch.ones(3, 30, 41), torch.ones(3, 50, 20)], size_divisible=32)
    assert isinstance(il, ImageList)
    assert il.tensors.shape == (2, 3, 64, 64)
    assert il.image_sizes == [(30, 41), (50, 20)]
    assert il.tensors[0, :, 30:].abs().sum() == 0 and il.tensors[0, :, :30, :41].min() == 1


def test_anchor_generator_counts_and_order():
    sizes = ((32,), (64,), (128,))
    ratios = ((0.5, 1.0, 2.0),) * 3
    ag = AnchorGenerator(sizes, ratios)
    images = ImageList(torch.zeros(2, 3, 64, 96), [(64, 96), (60, 90)])
    feats = [torch.zeros(2, 8, 16, 24), torch.zeros(2, 8, 8, 12), torch.zeros(2, 8, 4, 6)]
    anchors = ag(images, feats)
    assert len(anchors) == 2
    assert anchors[0].shape == ((16 * 24 + 8 * 12 + 4 * 6) * 3, 4)
    cell = generate_cell_anchors((32,), (0.5, 1.0, 2.0))
    assert torch.equal(anchors[0][:3], cell)  # location (0, 0) first
    assert torch.equal(anchors[0][3:6], cell + torch.tensor([4.0, 0.0, 4.0, 0.0]))  # next column, stride 4
    # same anchors as torchvision's generator
    from torchvision.models.detection.anchor_utils import AnchorGenerator as TvAG
    from torchvision.models.detection.image_list import ImageList as TvIL

    tv = TvAG(sizes, ratios)(TvIL(images.tensors, images.image_sizes), feats)
    assert torch.equal(tv[0], anchors[0])


def test_box_coder_round_trip():
    torch.manual_seed(0)
    coder = BoxCoder((10.0, 10.0, 5.0, 5.0))
    xy = torch.rand(50, 2) * 100
    ref = torch.cat([xy, xy + 1 + torch.rand(50, 2) * 50], 1)
    xy2 = torch.rand(50, 2) * 100
    gt = torch.cat([xy2, xy2 + 1 + torch.rand(50, 2) * 50], 1)
    deltas = coder.encode(gt, ref)
    assert torch.allclose(coder.decode(deltas, ref), gt, atol=1e-3)
    # K boxes per reference (class-specific) decode into K groups of four
    assert coder.decode(deltas.repeat(1, 3), ref).shape == (50, 12)
    # dw is clamped at log(1000 / 16)
    huge = coder.decode(torch.tensor([[0.0, 0.0, 100.0, 0.0]]), torch.tensor([[0.0, 0.0, 10.0, 10.0]]))
    assert torch.isfinite(huge).all() and huge[0, 2] - huge[0, 0] == pytest.approx(10 * 1000 / 16, rel=1e-4)


def test_matcher_thresholds_and_low_quality_matches():
    iou = torch.tensor([[0.9, 0.5, 0.1, 0.0], [0.1, 0.6, 0.2, 0.35]])
    m = Matcher(0.7, 0.3, allow_low_quality_matches=False)(iou)
    assert m.tolist() == [0, -2, -1, -2]
    m = Matcher(0.7, 0.3, allow_low_quality_matches=True)(iou)
    assert m.tolist() == [0, 1, -1, -2]  # pred 1 is gt 1's best match
    none = Matcher(0.5, 0.5)(torch.zeros(0, 4))
    assert none.tolist() == [-1, -1, -1, -1]


def test_sampler_balances_positives_and_negatives():
    torch.manual_seed(0)
    labels = torch.cat([torch.ones(100), torch.zeros(1000), -torch.ones(10)])
    pos, neg = BalancedPositiveNegativeSampler(64, 0.25)([labels])
    assert int(pos[0].sum()) == 16 and int(neg[0].sum()) == 48
    assert (labels[pos[0].bool()] == 1).all() and (labels[neg[0].bool()] == 0).all()
    few = torch.cat([torch.ones(3), torch.zeros(1000)])
    pos, neg = BalancedPositiveNegativeSampler(64, 0.25)([few])
    assert int(pos[0].sum()) == 3 and int(neg[0].sum()) == 61


def test_pooler_shapes():
    from detops.modeling.poolers import make_pooler

    cfg = get_cfg()
    pooler = make_pooler(cfg.MODEL.ROI_BOX_HEAD)
    feats = {str(i): torch.rand(2, 4, 64 // 2 ** i, 64 // 2 ** i) for i in range(4)}
    boxes = [torch.tensor([[0.0, 0.0, 200.0, 200.0], [10.0, 10.0, 20.0, 20.0]]), torch.tensor([[5.0, 5.0, 100.0, 60.0]])]
    out = pooler(feats, boxes, [(256, 256), (256, 256)])
    assert out.shape == (3, 4, 7, 7)


def test_top_k_per_group():
    group = torch.tensor([0, 1, 0, 1, 0, 2])
    order = torch.tensor([4, 3, 0, 1, 2])  # best first
    kept, counts = top_k_per_group(group, order, 2, 4)
    assert kept.tolist() == [4, 0, 3, 1] and counts == [2, 2, 0, 0]


def test_paste_masks_matches_torchvision():
    torch.manual_seed(0)
    from torchvision.models.detection.roi_heads import paste_masks_in_image as tv_paste

    masks = torch.rand(5, 1, 28, 28)
    boxes = torch.tensor([[0.0, 0.0, 30.0, 40.0], [10.5, 3.2, 80.0, 70.1], [-5.0, -5.0, 20.0, 20.0],
                          [60.0, 50.0, 120.0, 90.0], [3.0, 3.0, 3.5, 3.5]])
    assert torch.equal(paste_masks_in_image(masks, boxes, (80, 100)), tv_paste(masks, boxes, (80, 100)))
    assert paste_masks_in_image(masks[:0], boxes[:0], (8, 10)).shape == (0, 1, 8, 10)
