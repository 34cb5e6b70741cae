"""torch.export of modules that call detops ops, with dynamic box counts."""
import torch

import detops
from detops.ops import batched_nms, nms, roi_align


def _boxes(n, seed, size=60.0):
    g = torch.Generator().manual_seed(seed)
    xy = torch.rand(n, 2, generator=g) * size
    return torch.cat([xy, xy + 2 + torch.rand(n, 2, generator=g) * size / 2], 1), torch.rand(n, generator=g)


def _rois(k, seed, batch=2):
    boxes, _ = _boxes(k, seed)
    index = torch.randint(0, batch, (k, 1), generator=torch.Generator().manual_seed(seed)).float()
    return torch.cat([index, boxes], 1)


def test_export_roi_align_dynamic_roi_count():
    class Pool(torch.nn.Module):
        def forward(self, features, rois):
            return roi_align(features, rois, (7, 7), spatial_scale=0.25, sampling_ratio=2, aligned=True)

    features = torch.randn(2, 8, 24, 32)
    k = torch.export.Dim("k", min=2)
    ep = torch.export.export(Pool(), (features, _rois(10, 0)), dynamic_shapes=({}, {0: k}))
    assert any("detops.roi_align" in str(node.target) for node in ep.graph.nodes)
    for size in (3, 10, 57):
        rois = _rois(size, size)
        got = ep.module()(features, rois)
        assert got.shape == (size, 8, 7, 7)
        assert torch.equal(got, Pool()(features, rois))


def test_export_detection_head_nms_then_roi_align():
    """Post-processing as a detector does it: NMS and per-class NMS on the proposals, then
    RoIAlign on the kept boxes (a data-dependent count)."""

    class Head(torch.nn.Module):
        def forward(self, features, boxes, scores, labels):
            keep = nms(boxes, scores, 0.6)
            kept = batched_nms(boxes, scores, labels, 0.5)
            rois = torch.cat([torch.zeros_like(boxes[keep, :1]), boxes[keep]], 1)
            return keep, kept, roi_align(features, rois, 5, 0.5, 2, False)

    features = torch.randn(1, 4, 40, 40)
    boxes, scores = _boxes(50, 1)
    labels = torch.randint(0, 3, (50,))
    n = torch.export.Dim("n", min=2)
    ep = torch.export.export(
        Head(), (features, boxes, scores, labels), dynamic_shapes=({}, {0: n}, {0: n}, {0: n})
    )
    for size in (5, 50, 300):
        boxes, scores = _boxes(size, 100 + size)
        labels = torch.randint(0, 3, (size,))
        got = ep.module()(features, boxes, scores, labels)
        want = Head()(features, boxes, scores, labels)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    assert detops.ops.nms is nms
