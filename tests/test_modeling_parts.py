"""Parts of the detector on CPU: config, registry, structures, anchors, box coder, matcher,
sampler, pooler, post-processing helpers."""
import pytest
import torch

from detops.config import get_cfg
from detops.modeling.balanced_positive_negative_sampler import BalancedPositiveNegativeSampler
from detops.modeling.box_coder import BoxCoder
from detops.modeling.matcher import Matcher
from detops.modeling.registry import BACKBONES, Registry
from detops.modeling.roi_heads.mask_head.inference import paste_masks_in_image
from detops.modeling.rpn.anchor_generator import AnchorGenerator, generate_cell_anchors
from detops.modeling.utils import pad_targets, top_k_per_group
from detops.structures import BoxList, ImageList, boxlist_iou, cat_boxlist, to_image_list
from detops.testing import random_rois
from tests.conftest import DEVICES


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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("low_quality", [False, True])
def test_matcher_batch_is_the_per_image_matcher_on_the_valid_rows(device, low_quality):
    g = torch.Generator().manual_seed(0)
    m = Matcher(0.7, 0.3, allow_low_quality_matches=low_quality)
    counts = [3, 0, 5, 1]
    quality = torch.rand(4, 6, 50, generator=g)
    quality[0, 1, 7] = quality[0, 1].max() + 0.5  # a gt whose best prediction is above the threshold
    quality[2, 4] = 0.1  # a gt that overlaps every prediction equally: all of them tie
    valid = torch.arange(6)[None] < torch.tensor(counts)[:, None]
    got = m.match_batch(quality.to(device), valid.to(device)).cpu()
    assert got.shape == (4, 50) and got.dtype == torch.int64
    for b, n in enumerate(counts):
        assert torch.equal(got[b], m(quality[b, :n])), b
    assert (got[1] == Matcher.BELOW_LOW_THRESHOLD).all()  # no gt: all background
    assert torch.equal(m.match_batch(quality[:, :0]), torch.full((4, 50), -1))
    with pytest.raises(ValueError, match="Matcher: the quality matrix must be \\[M, N\\]"):
        m(quality)


def test_box_iou_batched_is_each_entry_matrix():
    a, b = random_rois(12, 1, 50, 60, seed=1)[:, 1:].view(3, 4, 4), random_rois(15, 1, 50, 60, seed=2)[:, 1:].view(3, 5, 4)
    from detops.structures.boxlist_ops import box_iou

    got = box_iou(a, b)
    assert got.shape == (3, 4, 5)
    for i in range(3):
        assert torch.equal(got[i], box_iou(a[i], b[i]))


@pytest.mark.parametrize("device", DEVICES)
def test_pad_targets(device):
    def target(n, seed):
        t = BoxList(random_rois(n, 1, 40, 50, seed=seed)[:, 1:].to(device), (50, 40))
        t.add_field("labels", torch.arange(1, n + 1, device=device))
        return t

    targets = [target(3, 0), target(0, 1), target(9, 2)]
    p = pad_targets(targets)
    assert p.boxes.shape == (3, 16, 4) and p.labels.shape == p.valid.shape == (3, 16)
    for b, t in enumerate(targets):
        n = len(t)
        assert torch.equal(p.boxes[b, :n], t.bbox) and (p.boxes[b, n:] == 0).all()
        assert torch.equal(p.labels[b, :n], t.get_field("labels")) and (p.labels[b, n:] == 0).all()
        assert p.valid[b, :n].all() and not p.valid[b, n:].any()
    assert pad_targets(targets[:1], multiple=4).boxes.shape == (1, 4, 4)
    none = pad_targets([targets[1], targets[1]])
    assert none.boxes.shape == (2, 8, 4) and not none.valid.any()
    assert pad_targets([BoxList(torch.zeros(2, 4, device=device), (5, 5))]).labels.abs().sum() == 0  # no labels


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


def test_fixed_shape_sampler_draws_like_the_list_sampler():
    torch.manual_seed(0)
    sampler = BalancedPositiveNegativeSampler(64, 0.25)
    rows = [
        torch.cat([torch.ones(100), torch.zeros(1000), -torch.ones(10)]),  # 16 positives, 48 negatives
        torch.cat([torch.full((3,), 2.0), torch.zeros(1097), -torch.ones(10)]),  # 3 and 61
        torch.cat([torch.ones(30), torch.zeros(20), -torch.ones(1060)]),  # 16 and 20: slots left empty
    ]
    labels = torch.stack([r[torch.randperm(r.numel())] for r in rows])
    idx, valid = sampler.sample(labels)
    assert idx.shape == valid.shape == (3, 64)
    for row, (i, v, want_pos, want_neg) in enumerate(zip(idx, valid, (16, 3, 16), (48, 61, 20))):
        drawn = labels[row][i[v]]
        assert drawn.numel() == want_pos + want_neg and len(set(i[v].tolist())) == drawn.numel()
        assert (drawn[:want_pos] >= 1).all() and (drawn[want_pos:] == 0).all()  # positives first
        assert v[: drawn.numel()].all() and not v[drawn.numel():].any()  # valid slots first
    # uniform: every positive of row 0 is drawn about 16 / 100 of the time
    hits = torch.zeros(labels.shape[1])
    for _ in range(300):
        idx, valid = sampler.sample(labels[:1])
        hits.index_add_(0, idx[0][valid[0]], torch.ones(int(valid.sum())))
    freq = hits[labels[0] >= 1] / 300
    assert abs(freq.mean().item() - 0.16) < 0.01 and freq.min() > 0.05 and freq.max() < 0.3
    # fewer candidates than the batch size
    small_idx, small_valid = sampler.sample(torch.tensor([[1.0, 0.0, -1.0, 0.0]]))
    assert small_idx.shape == (1, 4) and small_valid.tolist() == [[True, True, True, False]]
    assert small_idx[0, 0] == 0 and set(small_idx[0, 1:3].tolist()) == {1, 3}
    with pytest.raises(ValueError, match="labels must be \\[B, N\\]"):
        sampler.sample(torch.zeros(5))


def _rpn_postprocessor(pre, post):
    from detops.modeling.rpn.inference import RPNPostProcessor

    return RPNPostProcessor((pre, pre), (post, post), 0.7, 0.0, 0.0, BoxCoder((1.0, 1.0, 1.0, 1.0)))


@pytest.mark.parametrize("device", DEVICES)
def test_rpn_training_proposals_are_the_eval_proposals_padded(device):
    # The fixed-shape training path (nms_padded per image and level, then the best post_nms_top_n
    # across levels) keeps the boxes of the batched-NMS path, in the same order, then pads.
    g = torch.Generator().manual_seed(0)
    levels = [600, 150, 40]
    total = sum(levels)
    anchors = [random_rois(total, 1, 200, 300, seed=s)[:, 1:].to(device) for s in range(2)]
    objectness = torch.randn(2 * total, 1, generator=g).to(device)
    deltas = (torch.randn(2 * total, 4, generator=g) * 0.2).to(device)
    sizes = [(200, 300), (180, 250)]
    for pre, post in ((100, 120), (500, 1000)):
        proc = _rpn_postprocessor(pre, post)
        ref = proc.eval()(anchors, objectness, deltas, levels, sizes)
        got = proc.train()(anchors, objectness, deltas, levels, sizes)
        want = min(post, len(levels) * min(pre, max(levels)))
        for r, p in zip(ref, got):
            valid = p.get_field("valid")
            n = len(r)
            assert len(p) == want and valid[:n].all() and not valid[n:].any()
            torch.testing.assert_close(p.bbox[:n], r.bbox, rtol=0, atol=0)
            # the sigmoid of the same logits (vectorized over other lengths: 1 ulp)
            torch.testing.assert_close(p.get_field("objectness")[:n], r.get_field("objectness"), rtol=3e-7, atol=0)
            assert (p.bbox[n:] == 0).all()


def _box_loss_evaluator(batch=16, fraction=0.25):
    from detops.modeling.roi_heads.box_head.loss import FastRCNNLossComputation

    return FastRCNNLossComputation(Matcher(0.5, 0.5), BalancedPositiveNegativeSampler(batch, fraction),
                                   BoxCoder((10.0, 10.0, 5.0, 5.0)))


def test_box_head_sampling_and_losses_leave_padding_out():
    import torch.nn.functional as F

    torch.manual_seed(0)
    ev = _box_loss_evaluator()
    gt = BoxList(torch.tensor([[10.0, 10.0, 50.0, 60.0], [100.0, 80.0, 160.0, 150.0]]), (200, 200))
    gt.add_field("labels", torch.tensor([3, 5]))
    empty = BoxList(torch.zeros(0, 4), (200, 200))
    empty.add_field("labels", torch.zeros(0, dtype=torch.int64))
    props = []
    for n_valid in (12, 30):
        b = random_rois(30, 1, 200, 200, seed=n_valid)[:, 1:]
        b[:3] = gt.bbox[torch.tensor([0, 1, 0])] + 2.0  # positives
        p = BoxList(b, (200, 200))
        p.add_field("valid", torch.arange(30) < n_valid)
        props.append(p)
    sampled = ev.subsample(props, [gt, empty])
    assert [len(s) for s in sampled] == [16, 16]
    first, second = sampled
    v = first.get_field("valid")
    # image 0: 12 valid proposals (3 positive) + 2 gt: 4 of the 5 positives, all 9 negatives;
    # image 1 has no gt: every valid proposal is a negative
    assert int(v.sum()) == 13 and int(second.get_field("valid").sum()) == 16
    assert (second.get_field("labels") == 0).all()
    lab = first.get_field("labels")
    npos = int((lab > 0).sum())
    assert npos == 4 and (lab[:npos] > 0).all() and (lab[npos:] == 0).all() and v[:npos].all()
    assert (first.get_field("regression_targets")[lab == 0] == 0).all()

    logits = torch.randn(32, 6, requires_grad=True)
    regression = torch.randn(32, 24, requires_grad=True)
    cls_loss, box_loss = ev(logits, regression, sampled)
    valid = torch.cat([s.get_field("valid") for s in sampled])
    labels = torch.cat([s.get_field("labels") for s in sampled])
    targets = torch.cat([s.get_field("regression_targets") for s in sampled])
    ref_cls = F.cross_entropy(logits[valid], labels[valid])
    pos = torch.where(valid & (labels > 0))[0]
    ref_box = F.smooth_l1_loss(regression.reshape(32, 6, 4)[pos, labels[pos]], targets[pos], beta=1 / 9,
                               reduction="sum") / int(valid.sum())
    torch.testing.assert_close(cls_loss, ref_cls)
    torch.testing.assert_close(box_loss, ref_box)
    (cls_loss + box_loss).backward()
    assert torch.isfinite(logits.grad).all() and (logits.grad[~valid] == 0).all()
    assert torch.isfinite(regression.grad).all() and (regression.grad[~valid] == 0).all()


def test_mask_loss_leaves_padding_out():
    from detops.modeling.roi_heads.mask_head.loss import mask_rcnn_loss

    torch.manual_seed(0)
    masks = torch.zeros(2, 64, 64, dtype=torch.uint8)
    masks[0, 5:30, 5:40] = 1
    masks[1, 30:60, 20:50] = 1
    t = BoxList(torch.tensor([[5.0, 5.0, 40.0, 30.0], [20.0, 30.0, 50.0, 60.0]]), (64, 64))
    t.add_field("masks", masks)
    p = BoxList(torch.tensor([[4.0, 4.0, 41.0, 31.0], [0.0, 0.0, 0.0, 0.0], [19.0, 29.0, 52.0, 61.0]]), (64, 64))
    p.add_field("labels", torch.tensor([2, 0, 4]))
    p.add_field("matched_idxs", torch.tensor([0, 0, 1]))
    p.add_field("valid", torch.tensor([True, False, True]))
    logits = torch.randn(3, 5, 14, 14, requires_grad=True)
    loss = mask_rcnn_loss(logits, [p], [t])
    keep = torch.tensor([0, 2])
    ref = mask_rcnn_loss(logits[keep], [p[keep]], [t])
    torch.testing.assert_close(loss, ref)
    loss.backward()
    assert (logits.grad[1] == 0).all() and logits.grad[0].abs().sum() > 0
    # without gt masks every slot is padding: the loss is 0
    none = BoxList(torch.zeros(0, 4), (64, 64))
    none.add_field("masks", torch.zeros(0, 64, 64, dtype=torch.uint8))
    p.add_field("valid", torch.zeros(3, dtype=torch.bool))
    assert mask_rcnn_loss(logits, [p], [none]).item() == 0


def test_mask_targets_of_several_images_come_from_one_roi_align_with_the_same_values():
    from detops.modeling.roi_heads.mask_head.loss import _mask_targets

    g = torch.Generator().manual_seed(0)
    masks = [(torch.rand(n, 40, 48, generator=g) > 0.5).to(torch.uint8) for n in (3, 2)]
    positive = []
    for n_gt, seed in ((3, 1), (2, 2)):
        p = BoxList(random_rois(5, 1, 40, 48, seed=seed)[:, 1:], (48, 40))
        p.add_field("matched_idxs", torch.randint(0, n_gt, (5,), generator=g))
        positive.append(p)
    like = torch.zeros(1)
    batched = _mask_targets(positive, masks, 14, like)
    per_image = torch.cat([_mask_targets([p], [m], 14, like) for p, m in zip(positive, masks)])
    assert batched.shape == (10, 14, 14) and torch.equal(batched, per_image)
    # masks of other sizes, and images without positives, take the per-image path
    other = [masks[0], masks[1][:, :30]]
    mixed = _mask_targets(positive, other, 14, like)
    assert torch.equal(mixed[:5], per_image[:5]) and not torch.equal(mixed[5:], per_image[5:])
    assert _mask_targets([positive[0][:0], positive[1]], masks, 14, like).shape == (5, 14, 14)
