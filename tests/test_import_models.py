"""Real model definitions from torchvision, timm and transformers (tiny configurations, random weights, nothing
downloaded) imported with from_torch, against torch: the forward in eval mode (relative error below 1e-3 in
float32) and one SGD step in training mode in float64 (the loss, the updated parameters and running statistics)."""

from __future__ import annotations

import copy
from functools import partial

import numpy as np
import pytest
from model_libraries import library

import ember

torch = pytest.importorskip("torch")
# each model is exported and run on the reference backend: the full tier
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_dynamo")]


def torchvision_model(name: str):
    """A tiny member of a torchvision family (its class with a small configuration where it takes one), for 10
    classes, with no dropout or stochastic depth (random masks torch and ember draw differently)."""
    models = library("torchvision").models
    from torchvision.models import efficientnet, regnet, resnet, swin_transformer, vgg
    from torchvision.models.convnext import CNBlockConfig

    swin = {"patch_size": [4, 4], "embed_dim": 16, "depths": [1, 1], "num_heads": [2, 2], "window_size": [4, 4],
            "stochastic_depth_prob": 0.0, "num_classes": 10}
    tiny = {
        "vit": lambda: models.VisionTransformer(image_size=64, patch_size=16, num_layers=2, num_heads=2,
                                                hidden_dim=16, mlp_dim=32, num_classes=10),
        "swin": lambda: models.SwinTransformer(**swin),
        "swin_v2": lambda: models.SwinTransformer(**swin, block=swin_transformer.SwinTransformerBlockV2,
                                                  downsample_layer=swin_transformer.PatchMergingV2),
        "maxvit": lambda: models.MaxVit(input_size=(64, 64), stem_channels=16, partition_size=2,
                                        block_channels=[16, 32], block_layers=[1, 1], head_dim=8,
                                        stochastic_depth_prob=0.0, num_classes=10),
        "convnext": lambda: models.ConvNeXt([CNBlockConfig(16, 32, 1), CNBlockConfig(32, None, 1)],
                                            stochastic_depth_prob=0.0, num_classes=10),
        "efficientnet_b0": lambda: models.efficientnet_b0(num_classes=10, stochastic_depth_prob=0.0, dropout=0.0),
        "efficientnet_v2": lambda: models.EfficientNet(
            [efficientnet.FusedMBConvConfig(1, 3, 1, 16, 16, 1), efficientnet.FusedMBConvConfig(4, 3, 2, 16, 24, 1),
             efficientnet.MBConvConfig(4, 3, 2, 24, 32, 1)], dropout=0.0, stochastic_depth_prob=0.0,
            num_classes=10, norm_layer=partial(torch.nn.BatchNorm2d, eps=1e-3), last_channel=64),
        "mobilenet_v2": lambda: models.MobileNetV2(num_classes=10, width_mult=0.25, dropout=0.0),
        "mnasnet": lambda: models.MNASNet(0.5, num_classes=10, dropout=0.0),
        "densenet": lambda: models.DenseNet(growth_rate=8, block_config=(2, 2), num_init_features=16, bn_size=2,
                                            num_classes=10),
        "resnext": lambda: models.ResNet(resnet.Bottleneck, [1, 1, 1, 1], num_classes=10, groups=4,
                                         width_per_group=4),
        "regnet_y": lambda: models.RegNet(regnet.BlockParams.from_init_params(
            depth=4, w_0=8, w_a=8.0, w_m=2.0, group_width=8, se_ratio=0.25), num_classes=10),
        "alexnet": lambda: narrowed(models.alexnet(num_classes=10, dropout=0.0)),
        "vgg": lambda: narrowed(models.VGG(vgg.make_layers([8, "M", 16, "M", 32, "M"], batch_norm=True),
                                           num_classes=10, dropout=0.0), features=32),
        # in training mode these return their auxiliary classifiers' logits too (a named tuple, as torch's)
        "googlenet": lambda: models.GoogLeNet(num_classes=10, aux_logits=True, dropout=0.0, dropout_aux=0.0),
        "inception_v3": lambda: models.Inception3(num_classes=10, aux_logits=True, dropout=0.0),
    }
    if name in tiny:
        return tiny[name]()
    if name in ("mobilenet_v3_small", "squeezenet1_1"):
        return getattr(models, name)(num_classes=10, dropout=0.0)
    return getattr(models, name)(num_classes=10)


def narrowed(model, features: int | None = None):
    """AlexNet or VGG with its classifier's 4096-wide layers 32 wide (the same layers; a test of millions of
    parameters fewer), reading `features` channels of 7x7 (by default, as many as before)."""
    layers = list(model.classifier)
    linear = [i for i, layer in enumerate(layers) if isinstance(layer, torch.nn.Linear)]
    first = layers[linear[0]].in_features if features is None else features * 49
    widths = [first] + [32] * (len(linear) - 1) + [layers[linear[-1]].out_features]
    for k, i in enumerate(linear):
        layers[i] = torch.nn.Linear(widths[k], widths[k + 1])
    model.classifier = torch.nn.Sequential(*layers)
    return model


def timm_model(name: str):
    timm = library("timm")
    extra = {"img_size": 64, "patch_size": 16, "depth": 2} if name.startswith("vit") else {}
    kwargs = {"drop_path_rate": 0.0, "drop_rate": 0.0} if name.startswith("efficientnet") else {}
    return timm.create_model(name, pretrained=False, num_classes=10, **extra, **kwargs)


def transformers_model(name: str):
    transformers = library("transformers")
    if name.startswith("gpt2"):  # gpt2: attention written out by transformers; gpt2-sdpa: torch's attention
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                         attn_implementation="sdpa" if name == "gpt2-sdpa" else "eager")
        return transformers.GPT2LMHeadModel(config)
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=100, num_labels=3,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(config)


IMAGE_MODELS = [("torchvision", n) for n in (
    "resnet18", "mobilenet_v3_small", "efficientnet_b0", "vit", "swin", "convnext", "regnet_x_400mf", "squeezenet1_1",
    "shufflenet_v2_x0_5", "alexnet", "vgg", "googlenet", "inception_v3", "densenet", "mnasnet", "mobilenet_v2",
    "resnext", "efficientnet_v2", "maxvit", "swin_v2", "regnet_y")]
IMAGE_MODELS += [("timm", n) for n in ("efficientnet_b0", "regnetx_002", "vit_tiny_patch16_224", "resnet18")]


def logits(out):
    return out.logits if hasattr(out, "logits") else out["logits"] if isinstance(out, dict) else out


def relative(a, b) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


def calibrate(model, torch_args) -> None:
    """Batch norms' running statistics those of the batch, as a trained model's would be: with fresh statistics
    (0 and 1) a deep network's eval activations vanish and its logits are its last bias, which any import
    matches."""
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.momentum = 1.0
    with torch.no_grad():
        model.train()(*torch_args)
    for m, momentum in zip(norms, momenta):
        m.momentum = momentum


def enliven(model) -> None:
    """Weights initialized to zero (ViT's head) drawn small and random instead: a zero head gives zero logits
    and no gradient below it, which any import matches."""
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2 and not p.any():
                p.normal_(0, 0.02)


def check(model, args, torch_args, target, torch_target, atol: float = 1e-9):
    """The eval forward in float32, then one training step of both in float64 (in float32 the step of a deep
    batch-normalized network differs by rounding alone by up to 2% between any two implementations: RegNet's
    stem, for one), compared; `atol`: the updated parameters' absolute tolerance (larger for a model that
    computes parts in float32 whatever its dtype)."""
    torch.manual_seed(0)
    enliven(model)
    calibrate(model, torch_args)
    em = ember.from_torch(copy.deepcopy(model))
    model.eval()
    em.eval()
    with torch.no_grad():
        expected = logits(model(*torch_args)).numpy()
    assert relative(logits(em(*args)).numpy(), expected) < 1e-3
    model = model.double().train()
    em = ember.from_torch(copy.deepcopy(model))
    wide = [a.to(torch.float64) if a.is_floating_point() else a for a in torch_args]
    args = [ember.tensor(a.numpy()) for a in wide]
    opt, eopt = torch.optim.SGD(model.parameters(), lr=0.1), ember.optim.SGD(em.parameters(), lr=0.1)
    out = logits(model(*wide))
    loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), torch_target)
    opt.zero_grad()
    loss.backward()
    opt.step()
    mine = logits(em(*args))
    my_loss = ember.nn.functional.cross_entropy(mine.reshape(-1, mine.shape[-1]), target)
    eopt.zero_grad()
    my_loss.backward()
    eopt.step()
    assert my_loss.item() == pytest.approx(loss.item(), rel=1e-6)
    state = em.state_dict()
    for k, v in model.state_dict().items():
        if v.dtype.is_floating_point:
            np.testing.assert_allclose(state[k].numpy(), v.numpy(), rtol=1e-6, atol=atol, err_msg=k)


@pytest.mark.parametrize("source,name", IMAGE_MODELS, ids=[f"{s}-{n}" for s, n in IMAGE_MODELS])
def test_image_models_import_and_train_as_in_torch(source, name):
    torch.manual_seed(1)
    model = torchvision_model(name) if source == "torchvision" else timm_model(name)
    # (batch norms over 2 values at 1x1 would amplify rounding to percents); Inception's auxiliary classifier
    # needs its full 299x299 input
    batch, size = {"inception_v3": (2, 299), "vgg": (4, 32)}.get(name, (4, 64))
    x = torch.randn(batch, 3, size, size)
    y = torch.randint(0, 10, (batch,))
    check(model, (ember.tensor(x.numpy()),), (x,), ember.tensor(y.numpy()), y)


@pytest.mark.parametrize("name", ["gpt2", "gpt2-sdpa", "bert"])
def test_transformers_models_import_and_train_as_in_torch(name):
    torch.manual_seed(2)
    model = transformers_model(name)
    ids = torch.randint(0, 100, (2, 8))
    if name.startswith("gpt2"):
        target = ids.reshape(-1)
    else:
        target = torch.randint(0, 3, (2,))
    check(model, (ember.tensor(ids.numpy()),), (ids,), ember.tensor(target.numpy()), target)


# -- the model zoo: more timm and transformers architectures (issue 37) -----------------------------------------
# One representative of each kind of layer the libraries' popular models add: distillation tokens, Swin's shifted
# windows, ConvNeXt's blocks, XCiT's cross-covariance attention (F.normalize), EdgeNeXt's positional encoding (a
# cumsum of a mask), LeViT's attention biases (cached on the module in eval mode: imported through torch.export),
# CrossViT's two branches of patch sizes and the cross-attention between their class tokens;
# Llama's RoPE, RMSNorm, gated MLP and grouped-query attention, T5's encoder-decoder with relative attention
# buckets, BART (a padding row in an embedding tied to the output layer), DistilBERT, and the transformers ViT.

ZOO_TIMM = {
    "deit_tiny_distilled_patch16_224": {"img_size": 64, "depth": 2},
    "swin_tiny_patch4_window7_224": {"img_size": 64, "embed_dim": 16, "depths": (1, 1), "num_heads": (2, 2),
                                     "window_size": 4},
    "convnext_atto": {},
    "xcit_nano_12_p16_224": {"img_size": 64, "depth": 2},
    "edgenext_xx_small": {},
    "levit_128s": {"img_size": 64},
    "crossvit_tiny_240": {"img_size": 64, "img_scale": (1.0, 1.0), "patch_size": (8, 16), "embed_dim": (16, 32),
                          "depth": ((1, 1, 0),), "num_heads": (2, 2), "mlp_ratio": (2.0, 2.0, 1.0)},
}


def zoo_transformers_model(name: str):
    """A tiny configuration of the transformers model `name` (no dropout) and its example arguments."""
    t = library("transformers")
    ids = torch.randint(0, 100, (2, 8))
    if name == "llama":
        config = t.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=100, max_position_embeddings=64, use_cache=False,
                               attn_implementation="sdpa")
        return t.LlamaForCausalLM(config), (ids,)
    if name == "mixtral":  # a mixture of experts: a router's top-k, histc of the chosen experts, grouped matmuls
        config = t.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=100, max_position_embeddings=64, use_cache=False,
                                 num_local_experts=4, num_experts_per_tok=2, attn_implementation="sdpa")
        return t.MixtralForCausalLM(config), (ids,)
    if name == "t5":
        config = t.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=100, dropout_rate=0.0,
                            use_cache=False, decoder_start_token_id=0, attn_implementation="eager")
        return t.T5ForConditionalGeneration(config), (ids, torch.ones_like(ids), torch.randint(0, 100, (2, 5)))
    if name == "bart":
        config = t.BartConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                              decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=100,
                              max_position_embeddings=64, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                              use_cache=False, attn_implementation="sdpa")
        ids[0, -2:] = config.pad_token_id  # a padded sequence
        return t.BartForConditionalGeneration(config), (ids,)
    if name == "distilbert":
        config = t.DistilBertConfig(dim=32, hidden_dim=64, n_layers=2, n_heads=2, vocab_size=100, dropout=0.0,
                                    attention_dropout=0.0, seq_classif_dropout=0.0, max_position_embeddings=64,
                                    num_labels=3, attn_implementation="sdpa")
        return t.DistilBertForSequenceClassification(config), (ids,)
    config = t.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, num_labels=10, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    return t.ViTForImageClassification(config), (torch.randn(2, 3, 32, 32),)


@pytest.mark.parametrize("name", list(ZOO_TIMM))
def test_zoo_timm_models_import_and_train_as_in_torch(name):
    torch.manual_seed(3)
    model = library("timm").create_model(name, pretrained=False, num_classes=10, drop_rate=0.0, drop_path_rate=0.0,
                                         **ZOO_TIMM[name])
    x = torch.randn(4, 3, 64, 64)
    y = torch.randint(0, 10, (4,))
    check(model, (ember.tensor(x.numpy()),), (x,), ember.tensor(y.numpy()), y)


@pytest.mark.parametrize("name", ["llama", "mixtral", "t5", "bart", "distilbert", "vit"])
def test_zoo_transformers_models_import_and_train_as_in_torch(name, monkeypatch):
    if name == "mixtral":  # torch's own grouped matmul takes no float64 (the training step's dtype): its fallback
        monkeypatch.setattr(library("transformers").integrations.moe, "_can_use_grouped_mm", lambda *a: False)
    torch.manual_seed(4)
    model, args = zoo_transformers_model(name)
    with torch.no_grad():
        out = logits(model(*args))
    target = torch.randint(0, out.shape[-1], out.shape[:-1]).reshape(-1)
    # (Llama's and T5's RMS norms, and Llama's rotary embedding, compute in float32 whatever the model's dtype:
    # their steps agree to float32's rounding)
    check(model, tuple(ember.tensor(a.numpy()) for a in args), args, ember.tensor(target.numpy()), target,
          atol=1e-7 if name in ("llama", "mixtral", "t5") else 1e-9)


# -- the same models under torch.compile(backend="ember") (issue 37) ----------------------------------------------
BACKEND_MODELS = [("torchvision", "resnet18"), ("torchvision", "resnet18-channels-last"),
                  ("torchvision", "mobilenet_v3_small"), ("torchvision", "vit"), ("transformers", "gpt2-sdpa"),
                  ("transformers", "bert")]


@pytest.mark.parametrize("source,name", BACKEND_MODELS, ids=[f"{s}-{n}" for s, n in BACKEND_MODELS])
def test_real_models_train_through_the_compile_backend_as_in_torch(source, name):
    """Real model definitions trained by `torch.compile(step, backend="ember")` (forward, loss, backward and SGD
    momentum in one compiled step, float64) take the steps torch eager takes: losses, parameters, running
    statistics; channels-last memory (the layout crosses the graphs' edges as it lies) as well."""
    import ember.frontends.dynamo  # noqa: F401  (registers the backend where the entry point is not installed)

    torch.manual_seed(4)
    if source == "torchvision":
        model = torchvision_model(name.removesuffix("-channels-last"))
        x = torch.randn(4, 3, 64, 64, dtype=torch.float64)
        y = torch.randint(0, 10, (4,))
        if name.endswith("channels-last"):
            model, x = model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    else:
        model = transformers_model(name)
        x = torch.randint(0, 100, (2, 8))
        y = x.reshape(-1) if name.startswith("gpt2") else torch.randint(0, 3, (2,))
    enliven(model)
    model = model.double().train()
    mine = copy.deepcopy(model)

    def stepper(net):
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)

        def step(x, y):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(logits(net(x)).flatten(0, -2), y)
            loss.backward()
            opt.step()
            return loss
        return step

    # (static shapes: each case compiles the same function, which dynamo would otherwise make dynamic)
    theirs, compiled = stepper(model), torch.compile(stepper(mine), backend="ember", dynamic=False)
    for _ in range(3):
        assert compiled(x, y).item() == pytest.approx(theirs(x, y).item(), rel=1e-9)
    state = mine.state_dict()
    for k, v in model.state_dict().items():
        np.testing.assert_allclose(state[k].numpy(), v.numpy(), rtol=1e-7, atol=1e-10, err_msg=k)
