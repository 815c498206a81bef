"""A trainable tail on cached features (data.trainable_tail, architecture: tail): the backbone's
last stage trained on the cached input maps of that stage, random-init backbones (offline)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import relative_error
from tests.methods.conftest import fake_images
from workbench.backbones import build_backbone
from workbench.backbones.tail import MatmulConv2d, build_tail, parameter_count, with_tail_input
from workbench.data import FederatedDataModule
from workbench.engines import LightningEngine
from workbench.federation.local_training import LocalTraining
from workbench.methods import AFL, FedAvg, Problem
from workbench.methods.analytic_start import AnalyticStart
from workbench.methods.heads import build_model

pytestmark = pytest.mark.usefixtures("one_thread")
SIZES = {"efficientnet_lite0": 64, "resnet18": 32}
MAPS = {"efficientnet_lite0": ("blocks.6", (192, 2, 2)), "resnet18": ("layer4", (256, 2, 2))}


def with_random_statistics(backbone):
    """BatchNorm statistics and affines away from the init's (0, 1, 1, 0): the fold is exercised."""
    gen = torch.Generator().manual_seed(1)
    for module in backbone.model.net.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            c = module.num_features
            module.running_mean.copy_(0.1 * torch.randn(c, generator=gen))
            module.running_var.copy_(0.5 + 1.5 * torch.rand(c, generator=gen))
            module.weight.data.copy_(0.5 + torch.rand(c, generator=gen))
            module.bias.data.copy_(0.1 * torch.randn(c, generator=gen))
    return backbone


@pytest.mark.parametrize("name", list(SIZES))
def test_the_tail_on_its_cached_input_is_the_backbones_pooled_features(name):
    backbone = with_random_statistics(build_backbone(name, pretrained=False, input_size=SIZES[name]))
    tail, maps = build_tail(backbone, 1), with_tail_input(backbone, 1)
    assert (maps.tail_input, maps.feature_shape) == MAPS[name]
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in tail.modules())
    x = torch.randn(4, 3, SIZES[name], SIZES[name])
    with torch.no_grad():
        pooled, cached = backbone.model(x), maps.model(x)  # the backbone's own forward still runs whole
        assert cached.shape == (4, maps.feature_dim)
        assert relative_error(tail(cached.view(4, *maps.feature_shape)), pooled) < 1e-5
    tail.train()  # no batch statistics: training mode computes the same function
    with torch.no_grad():
        assert relative_error(tail(cached.view(4, *maps.feature_shape)), pooled) < 1e-5


def tail_data(tmp_path, stages: int = 1, **kw) -> FederatedDataModule:
    dm = FederatedDataModule(dataset="tiny_images", backbone="efficientnet_lite0", pretrained=False, input_size=64,
                             trainable_tail=stages, cache_dir=str(tmp_path), num_clients=3, partition="iid",
                             min_partition_size=1, **kw)
    dm.setup()
    return dm


def test_the_data_module_caches_the_tails_input_under_its_own_key(add_dataset, tmp_path):
    add_dataset("tiny_images", fake_images)
    dm = tail_data(tmp_path)
    pooled = tail_data(tmp_path, stages=0)
    assert dm.input_shape == (192, 2, 2) and pooled.input_shape == (1280,) and pooled.tail is None
    assert len(list(tmp_path.rglob("*.pt"))) == 4  # train and test, maps and pooled features
    assert torch.equal(dm.train_labels, pooled.train_labels)
    with torch.no_grad():
        assert relative_error(dm.tail(dm.train_features), pooled.train_features) < 1e-5
    again = tail_data(tmp_path)  # read back from the cache
    assert torch.equal(again.train_features, dm.train_features)
    assert Problem.of(dm.population()).tail is dm.tail and Problem.of(pooled.population()).tail is None


def test_fedavg_trains_the_tail_and_sends_its_parameters(add_dataset, tmp_path, fit_method):
    add_dataset("tiny_images", fake_images)
    dm = tail_data(tmp_path)
    method = FedAvg(num_rounds=5, architecture="tail", local=LocalTraining(lr=0.01, batch_size=16, epochs=2))
    start = build_model("tail", dm.input_shape, dm.num_classes, tail=dm.tail)
    engine = fit_method(method, dm)
    size = parameter_count(method.net)
    assert size == parameter_count(dm.tail) + 1280 * 3 + 3
    assert engine.fit_metrics["comm/bytes_up"] == 5 * 3 * 4 * size  # every client, every round: Δw, float32
    with torch.no_grad():
        before = F.cross_entropy(start(dm.train_features), dm.train_labels)
        after = F.cross_entropy(method(dm.train_features), dm.train_labels)
    assert after < 0.5 * before  # measured 1.11 -> 0.31
    trained, pretrained = method.net[0].state_dict(), dm.tail.state_dict()
    assert all(not torch.equal(trained[key], pretrained[key]) for key in pretrained)  # every tail parameter moved


def test_afl_start_on_the_tail_is_afl_on_the_pooled_features(add_dataset, tmp_path, fit_method):
    """Round 0 of AFL+FT with the tail: the last layer fitted on body(x) = tail(x), the pooled
    features, so (lr 0, τ 1) its logits are AFL's on the ordinary features."""
    add_dataset("tiny_images", fake_images)
    dm, pooled = tail_data(tmp_path), tail_data(tmp_path, stages=0)
    settings = {"gamma_out": 1.0, "bias": True}
    method = FedAvg(num_rounds=1, architecture="tail", local=LocalTraining(lr=0.0),
                    init_from=AnalyticStart(method="AFL", settings=settings, temperatures=(1.0,)))
    fit_method(method, dm)
    afl = AFL(**settings)
    fit_method(afl, pooled)
    with torch.no_grad():
        got, expected = method(dm.test_features).double(), afl(pooled.test_features.double()).double()
    assert relative_error(got, expected) < 1e-4
    assert torch.equal(got.argmax(1), expected.argmax(1))


def test_tails_are_refused_where_they_do_not_apply(add_dataset, tmp_path):
    add_dataset("tiny_images", fake_images)
    with pytest.raises(ValueError, match="trainable_tail"):  # analytic methods fit on feature vectors
        LightningEngine(AFL()).check_data(tail_data(tmp_path), fitting=True)
    with pytest.raises(ValueError, match=r"data\.trainable_tail"):  # no tail in the data
        build_model("tail", (1280,), 3)
    with pytest.raises(ValueError, match="text backbone"):
        FederatedDataModule(dataset="ag_news", backbone="all_minilm_l6_v2", trainable_tail=1, cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="inputs=features"):
        FederatedDataModule(dataset="tiny_images", inputs="images", trainable_tail=1)
    with pytest.raises(ValueError, match="feature_layers"):
        FederatedDataModule(dataset="tiny_images", feature_layers=["blocks.2"], trainable_tail=1,
                            cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="≥ 0"):
        FederatedDataModule(dataset="tiny_images", trainable_tail=-1, cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"\[1, 7\]"):
        tail_data(tmp_path, stages=8)
    with pytest.raises(ValueError, match="no tail builder"):
        build_tail(build_backbone("mobilenetv3_small_050", pretrained=False), 1)


def test_the_synthetic_tail_is_seeded_and_pure():
    from workbench.data import SyntheticBlobs

    blobs = SyntheticBlobs(num_classes=4, dim=8, train_size=60, test_size=20, seed=7)
    a, b = (FederatedDataModule(dataset="synthetic", synthetic=blobs, trainable_tail=2, num_clients=2) for _ in "ab")
    a.setup(), b.setup()
    assert a.input_shape == (8, 1, 1)
    assert all(torch.equal(x, y) for x, y in zip(a.tail.state_dict().values(), b.tail.state_dict().values(),
                                                 strict=True))
    assert a.tail(a.train_features).shape == (len(a.train_labels), 8)


CONVOLUTIONS = {  # (in, out, kernel, stride, padding, dilation, groups, bias) at an input size
    "pointwise": ((6, 5, 1, 1, 0, 1, 1, False), 3),
    "dense 3x3, stride 2, bias": ((4, 6, 3, 2, 1, 1, 1, True), 5),
    "pointwise, stride 2": ((4, 3, 1, 2, 0, 1, 1, False), 4),
    "depthwise 3x3": ((6, 6, 3, 1, 1, 1, 6, False), 2),
    "depthwise 5x5, stride 2": ((6, 6, 5, 2, 2, 1, 6, True), 7),
    "dilated 3x3": ((3, 4, 3, 1, 2, 2, 1, False), 6),
}


@pytest.mark.parametrize("case", list(CONVOLUTIONS))
def test_the_matmul_convolution_is_the_convolution(case):
    (c_in, c_out, kernel, stride, padding, dilation, groups, bias), size = CONVOLUTIONS[case]
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(c_in, c_out, kernel, stride, padding, dilation, groups, bias).double()
    products = MatmulConv2d(conv)
    assert dict(products.named_parameters()).keys() == dict(conv.named_parameters()).keys()
    x = torch.randn(3, c_in, size, size, dtype=torch.float64, requires_grad=True)
    expected, got = conv(x), products(x)
    assert got.shape == expected.shape and relative_error(got.detach(), expected.detach()) < 1e-12
    upstream = torch.randn_like(expected)
    wrt = [x, *conv.parameters()]
    for g, e in zip(torch.autograd.grad(got, wrt, upstream), torch.autograd.grad(expected, wrt, upstream), strict=True):
        assert relative_error(g.detach(), e.detach()) < 1e-12
    none = x[:0].detach()  # no rows (a process whose share is empty): an empty map of the right shape
    assert products(none).shape == conv(none).shape


def test_the_matmul_convolution_takes_timms_same_padding():
    from timm.layers import Conv2dSame

    torch.manual_seed(0)
    conv = Conv2dSame(5, 5, 3, stride=2, groups=5).double()  # the tf_ EfficientNets' depthwise stride-2
    x = torch.randn(2, 5, 5, 5, dtype=torch.float64)
    assert relative_error(MatmulConv2d(conv)(x), conv(x)) < 1e-12
    with pytest.raises(ValueError, match="dense or depthwise"):
        MatmulConv2d(torch.nn.Conv2d(4, 4, 3, groups=2))


@pytest.mark.parametrize("name", list(SIZES))
def test_every_clients_tail_gradient_under_vmap_is_its_own(name):
    """Local SGD takes all clients' steps at once (vmap over the client axis): each client's
    gradient is the one autograd gives it alone."""
    backbone = with_random_statistics(build_backbone(name, pretrained=False, input_size=SIZES[name]))
    tail = build_tail(backbone, 1)
    assert not any(type(m) is torch.nn.Conv2d for m in tail.modules())
    model = torch.nn.Sequential(tail, torch.nn.Linear(backbone.feature_dim, 10))
    gen = torch.Generator().manual_seed(0)
    clients, batch = 4, 8
    params = {k: v.detach() + 0.01 * torch.randn((clients, *v.shape), generator=gen)
              for k, v in model.named_parameters()}
    x = torch.randn(clients, batch, *MAPS[name][1], generator=gen)
    y = torch.randint(0, 10, (clients, batch), generator=gen)

    def loss(p, x, y):
        return F.cross_entropy(torch.func.functional_call(model, p, (x,)), y)

    together = torch.func.vmap(torch.func.grad(loss))(params, x, y)
    for k in range(clients):
        alone = torch.func.grad(loss)({key: value[k] for key, value in params.items()}, x[k], y[k])
        for key in params:
            assert relative_error(together[key][k], alone[key]) < 1e-5, (k, key)
