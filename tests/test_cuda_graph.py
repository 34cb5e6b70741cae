"""GraphedTraining: CUDA graphs of a training forward and backward give eager mode's values, and
every case a replay could get wrong runs eagerly instead. GraphedFunction: replays of a function
without gradients give its eager values and random draws."""
import copy
import pickle
from collections import OrderedDict

import pytest
import torch
from torch import nn

from detops.modeling.backbone.frozen_batch_norm import FrozenBatchNorm2d
from detops.modeling.cuda_graph import GraphedFunction, GraphedTraining, run_eagerly

from tests.test_modeling_train import _batch, _tiny_cfg

cuda = pytest.mark.cuda


class _Net(nn.Module):
    """A frozen stem, then two trainable stages whose outputs come back as a dict."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), FrozenBatchNorm2d(8), nn.ReLU(inplace=True))
        self.a = nn.Sequential(nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU())
        self.b = nn.Conv2d(16, 16, 3, stride=2, padding=1)
        for p in self.stem.parameters():
            p.requires_grad_(False)

    def forward(self, x):
        a = self.a(self.stem(x))
        b = self.b(a)
        # an output computed from another one, as the FPN's extra max-pooled level
        return OrderedDict(a=a, b=b, c=nn.functional.max_pool2d(b, 1, stride=2))


def _nets(device="cuda"):
    torch.manual_seed(0)
    net = _Net().to(device)
    return net, copy.deepcopy(net)


def _loss(out, target):
    return (out["a"] * target[0]).sum() + (out["b"] ** 2 * target[1]).mean() + out["c"].sin().sum()


def _data(shape=(2, 3, 32, 48), seed=0, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g).to(device)
    h, w = shape[2] // 2, shape[3] // 2
    t = (torch.randn(shape[0], 16, h, w, generator=g).to(device),
         torch.randn(shape[0], 16, (h + 1) // 2, (w + 1) // 2, generator=g).to(device))
    return x, t


def _grads(net):
    return [None if p.grad is None else p.grad.clone() for p in net.parameters()]


def _assert_same(a, b):
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            assert torch.equal(x, y)


@cuda
def test_steps_match_eager_bitwise():
    eager, graphed = _nets()
    runner = GraphedTraining(max_graphs=1, after=2)
    opts = [torch.optim.SGD([p for p in n.parameters() if p.requires_grad], lr=0.05, momentum=0.9) for n in (eager, graphed)]
    for step in range(6):
        x, t = _data(seed=step)
        losses = []
        for net, opt, run in ((eager, opts[0], lambda n, v: n(v)), (graphed, opts[1], runner)):
            opt.zero_grad(set_to_none=True)
            loss = _loss(run(net, x), t)
            loss.backward()
            losses.append(loss.detach())
            opt.step()
        assert torch.equal(losses[0], losses[1]), step
        _assert_same(_grads(eager), _grads(graphed))
    _assert_same(list(eager.parameters()), list(graphed.parameters()))
    assert runner.captures == 1 and runner.replays == 5  # the first call runs eagerly (after=2)


@cuda
@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradients_accumulate_like_eager(set_to_none):
    eager, graphed = _nets()
    runner = GraphedTraining(after=1)
    for net, run in ((eager, lambda n, v: n(v)), (graphed, runner)):
        net.zero_grad(set_to_none=set_to_none)
        for seed in range(3):  # three micro-batches into the same .grad
            x, t = _data(seed=seed)
            _loss(run(net, x), t).backward()
    assert runner.replays == 3
    _assert_same(_grads(eager), _grads(graphed))


@cuda
def test_gradients_handed_out_are_not_overwritten_by_the_next_replay():
    _, net = _nets()
    runner = GraphedTraining(after=1)
    x, t = _data(seed=0)
    _loss(runner(net, x), t).backward()
    kept = [p.grad for p in net.parameters() if p.grad is not None]
    copies = [g.clone() for g in kept]
    net.zero_grad(set_to_none=True)
    x, t = _data(seed=1)
    _loss(runner(net, x), t).backward()
    assert runner.replays == 2
    _assert_same(kept, copies)


@cuda
def test_two_forwards_before_one_backward():
    eager, graphed = _nets()
    runner = GraphedTraining(after=1)
    (x1, t1), (x2, t2) = _data(seed=1), _data(seed=2)
    (_loss(eager(x1), t1) + _loss(eager(x2), t2)).backward()
    loss = _loss(runner(graphed, x1), t1) + _loss(runner(graphed, x2), t2)
    assert runner.replays == 1  # the second forward ran eagerly: the first one's backward is pending
    loss.backward()
    _assert_same(_grads(eager), _grads(graphed))
    x3, t3 = _data(seed=3)
    _loss(runner(graphed, x3), t3).backward()
    assert runner.replays == 2


@cuda
def test_backward_of_an_older_replay_raises():
    _, net = _nets()
    runner = GraphedTraining(after=1)
    x, t = _data(seed=0)
    old = _loss(runner(net, x), t)
    old.backward(retain_graph=True)
    _loss(runner(net, x), t).backward()
    with pytest.raises(RuntimeError, match="GraphedTraining: backward through an older forward"):
        old.backward()


@cuda
def test_shapes_beyond_the_limit_run_eagerly():
    eager, graphed = _nets()
    runner = GraphedTraining(max_graphs=1, after=2)
    shapes = [(2, 3, 32, 48)] * 3 + [(2, 3, 64, 32)] * 3 + [(2, 3, 32, 48)]
    for i, shape in enumerate(shapes):
        x, t = _data(shape, seed=i)
        for net, run in ((eager, lambda n, v: n(v)), (graphed, runner)):
            net.zero_grad(set_to_none=True)
            _loss(run(net, x), t).backward()
        _assert_same(_grads(eager), _grads(graphed))
    assert runner.captures == 1 and len(runner.graphs) == 1
    assert runner.replays == 3  # calls 2, 3 and 7; the second shape found no free graph


@cuda
def test_new_parameter_storage_drops_the_graphs():
    eager, graphed = _nets()
    runner = GraphedTraining(after=1)
    for step in range(4):
        if step == 2:  # as .to() or a memory-format conversion would: same Parameter, new storage
            for net in (eager, graphed):
                with torch.no_grad():
                    net.b.weight.data = net.b.weight.data * 0.5
        x, t = _data(seed=step)
        for net, run in ((eager, lambda n, v: n(v)), (graphed, runner)):
            net.zero_grad(set_to_none=True)
            _loss(run(net, x), t).backward()
        _assert_same(_grads(eager), _grads(graphed))
    assert runner.captures == 2 and runner.replays == 4


@cuda
def test_hooks_eval_no_grad_and_autocast_run_eagerly():
    _, net = _nets()
    runner = GraphedTraining(after=1)
    x, t = _data()
    _loss(runner(net, x), t).backward()
    assert runner.replays == 1
    seen = []
    handle = net.a.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    _loss(runner(net, x), t).backward()
    handle.remove()
    assert seen and runner.replays == 1
    with torch.no_grad():
        runner(net, x)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _loss(runner(net, x), t).backward()
    net.eval()
    out = runner(net, x)
    assert runner.replays == 1
    net.train()
    _loss(runner(net, x), t).backward()
    assert runner.replays == 2 and runner.captures == 1
    assert torch.equal(out["b"], net(x)["b"])


@cuda
def test_batch_norm_with_running_statistics_runs_eagerly():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).cuda()
    runner = GraphedTraining(after=1)
    x = torch.randn(2, 3, 8, 8, device="cuda")
    runner(net, x).sum().backward()
    assert runner.captures == 0 and net[1].num_batches_tracked.item() == 1


def _train_side_by_side(*overrides, steps=5):
    """Two detectors built alike except for the config `overrides` (one list each), trained
    `steps` SGD steps on one batch with deterministic algorithms (no atomic adds in the heads'
    backward) and one seed per step: asserts their losses, gradients and weights are bitwise
    the same, and returns them."""
    from detops.modeling import build_detection_model

    was = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        models = []
        for extra in overrides:
            cfg = _tiny_cfg()
            cfg.merge_from_list(["MODEL.DEVICE", "cuda"] + extra)
            torch.manual_seed(0)
            models.append(build_detection_model(cfg).cuda().train())
        images, targets = _batch("cuda")
        opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.01, momentum=0.9) for m in models]
        for step in range(steps):
            losses, grads = [], []
            for model, opt in zip(models, opts):
                torch.manual_seed(step)  # the samplers draw the same proposals
                opt.zero_grad(set_to_none=True)
                out = model(images, targets)
                sum(out.values()).backward()
                grads.append(_grads(model))
                opt.step()
                losses.append({k: v.item() for k, v in out.items()})
            assert losses[0] == losses[1], step
            _assert_same(*grads)
        _assert_same(list(models[0].parameters()), list(models[1].parameters()))
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
    return models


@cuda
def test_detector_training_with_backbone_graphs_matches_eager():
    """A detector whose backbone replays CUDA graphs trains bitwise like an eager one,
    optimizer updates included."""
    eager, graphed = _train_side_by_side(*[["MODEL.BACKBONE.CUDA_GRAPHS", graphs, "MODEL.BACKBONE.CUDA_GRAPH_AFTER", 2]
                                           for graphs in (0, 1)])
    assert eager.backbone_graphs.replays == 0
    assert graphed.backbone_graphs.captures == 1 and graphed.backbone_graphs.replays == 4


def test_copies_keep_the_settings_and_drop_the_graphs():
    runner = GraphedTraining(max_graphs=3, after=4, warmup=2)
    runner.graphs[("fake",)] = object()
    runner.replays = 7
    for other in (copy.deepcopy(runner), pickle.loads(pickle.dumps(runner))):
        assert (other.max_graphs, other.after, other.warmup) == (3, 4, 2)
        assert not other.graphs and other.replays == 0


def test_cpu_inputs_run_eagerly():
    torch.manual_seed(0)
    net = _Net()
    runner = GraphedTraining(after=1)
    x, t = _data(device="cpu")
    out = runner(net, x)
    assert torch.equal(out["b"], net(x)["b"]) and runner.captures == 0


@pytest.mark.parametrize("kwargs", [dict(max_graphs=-1), dict(after=0), dict(warmup=0)])
def test_bad_settings(kwargs):
    with pytest.raises(ValueError, match="GraphedTraining: need max_graphs >= 0"):
        GraphedTraining(**kwargs)


def test_model_has_a_runner_from_the_config():
    from detops.modeling import build_detection_model

    cfg = _tiny_cfg()
    cfg.merge_from_list(["MODEL.BACKBONE.CUDA_GRAPHS", 2, "MODEL.BACKBONE.CUDA_GRAPH_AFTER", 5])
    model = build_detection_model(cfg)
    assert (model.backbone_graphs.max_graphs, model.backbone_graphs.after) == (2, 5)
    assert copy.deepcopy(model).backbone_graphs is not model.backbone_graphs


def test_model_without_a_runner_still_runs():
    """A model pickled before the runner existed has no `backbone_graphs` attribute."""
    from detops.modeling import build_detection_model

    model = build_detection_model(_tiny_cfg()).eval()
    images, _ = _batch()
    with torch.no_grad():
        expected = model(images)
        del model.__dict__["backbone_graphs"]
        got = model(images)
    assert all(torch.equal(a["boxes"], b["boxes"]) for a, b in zip(expected, got))


# --- GraphedFunction --------------------------------------------------------------------------


def _work(x, y):
    """Small launches, a random draw and outputs of several dtypes, as the detector's targets."""
    keys = torch.rand(x.shape, device=x.device)
    top, idx = torch.where(x > 0, keys, 2.0).topk(3, dim=1, largest=False)
    return (x * y).sum(1), idx, top < 2.0


@cuda
def test_function_replays_give_the_eager_values_and_random_draws():
    runner = GraphedFunction(after=2)
    g = torch.Generator().manual_seed(0)
    calls = [(torch.randn(4, 10, generator=g).cuda(), torch.randn(4, 10, generator=g).cuda()) for _ in range(5)]
    torch.manual_seed(1)
    expected = [run_eagerly(_work, *c) for c in calls]
    torch.manual_seed(1)
    got = [runner(_work, *c) for c in calls]
    assert runner.captures == 1 and runner.replays == 4  # captured at the second call, replayed from it on
    for e, o in zip(expected, got):
        for a, b in zip(e, o):
            assert a.dtype == b.dtype and torch.equal(a, b)
    # what the caller got is its own: later replays do not overwrite it
    first = [t.clone() for t in got[1]]
    runner(_work, *calls[0])
    assert all(torch.equal(a, b) for a, b in zip(first, got[1]))


@cuda
def test_function_keys_limits_and_cpu_inputs():
    runner = GraphedFunction(max_graphs=1, after=1)
    x, y = torch.randn(4, 10, device="cuda"), torch.randn(4, 10, device="cuda")
    runner(_work, x, y)
    runner(_work, x, y, key=("other",))  # another key, beyond max_graphs: eager
    runner(_work, x[:2], y[:2])  # another shape: eager
    assert runner.captures == 1 and runner.replays == 1
    out = runner(_work, x.cpu(), y.cpu())
    assert out[0].device.type == "cpu" and runner.replays == 1
    runner.reset()
    assert not runner.graphs and runner.captures == 0
    off = GraphedFunction(max_graphs=0, after=1)
    off(_work, x, y)
    assert off.captures == 0 and off.replays == 0


@cuda
def test_function_that_cannot_be_captured_runs_eagerly():
    def reads_back(x):
        noise = torch.rand(x.shape, device=x.device)
        return (x * float(x.sum()) + noise,)  # a host read: not capturable

    runner = GraphedFunction(after=1)
    x = torch.randn(8, device="cuda")
    torch.manual_seed(3)
    expected = [run_eagerly(reads_back, x)[0] for _ in range(2)] + [torch.rand(4, device="cuda")]
    torch.manual_seed(3)
    with pytest.warns(UserWarning, match="GraphedFunction: capturing .*reads_back failed"):
        out = runner(reads_back, x)
    assert runner.captures == 0 and runner.graphs  # remembered as eager: no second attempt or warning
    # the failed capture leaves the random generator usable, in the state it had
    got = [out[0], runner(reads_back, x)[0], torch.rand(4, device="cuda")]
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_function_runner_settings_and_copies():
    with pytest.raises(ValueError, match="GraphedFunction: need max_graphs >= 0"):
        GraphedFunction(after=0)
    runner = GraphedFunction(max_graphs=3, after=4, warmup=2)
    runner.graphs[("fake",)] = None
    for other in (copy.deepcopy(runner), pickle.loads(pickle.dumps(runner))):
        assert (other.max_graphs, other.after, other.warmup) == (3, 4, 2) and not other.graphs
    x = torch.randn(3, 5)
    assert torch.equal(runner(_work, x, x)[0], (x * x).sum(1))  # CPU: eager


@cuda
def test_detector_training_with_target_graphs_matches_eager():
    """The RPN's proposals and targets and the box head's sampling replayed from CUDA graphs
    give eager mode's losses and gradients bitwise, random draws of the samplers included."""
    eager, graphed = _train_side_by_side(*[["MODEL.BACKBONE.CUDA_GRAPHS", 0, "MODEL.TARGETS_CUDA_GRAPHS", graphs,
                                            "MODEL.TARGETS_CUDA_GRAPH_AFTER", 2] for graphs in (0, 2)])
    assert eager.rpn.target_graphs.replays == 0 and eager.roi_heads.box.loss_evaluator.graphs.replays == 0
    for runner in (graphed.rpn.target_graphs, graphed.roi_heads.box.loss_evaluator.graphs):
        assert runner.captures == 1 and runner.replays == 4
    assert copy.deepcopy(graphed).rpn.target_graphs.replays == 0
