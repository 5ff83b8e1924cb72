"""The scaled pair: a small engine pair embedded in a real model's shape, function unchanged.

The target keeps the small target's function inside Qwen3-8B's shape (hidden 4096, 36 layers,
32 query / 8 KV heads of 128, FFN 12288, vocabulary 151936, untied LM head); the drafter keeps
the small drafter's function inside the shape of the published DFlash drafter for Qwen3-8B.
Dense kernels do the same work whatever the values, so the pair costs what the real models
cost. docs/scaled-pair.md derives why each step below preserves the function exactly in real
arithmetic and where bf16 makes it approximate. In short, every hidden-size vector of the big
models is ``s * Q x_small + a * e_d``: ``Q`` (``D x d``) has orthonormal columns with disjoint
supports (``dense``: the ``D - 1`` channels other than ``d`` dealt out to the ``d`` small ones
with seeded coefficients; ``sparse``: the first ``d`` channels), ``e_d`` is the constant
channel, ``s**2 * d / D = k`` and ``a**2 = D * eps * (k - 1)``, so that every RMSNorm sees
``rms_big = sqrt(k) * rms_small`` exactly (the constant channel stands in for ``(k - 1)`` of
the ``eps``); norm weights are the small ones times ``sqrt(k) / s`` on each small channel's
big channels, readers are ``W Q^T`` and writers ``s Q W``:

- attention heads keep their GQA group (small head ``h`` of group ``g`` -> big head
  ``g * G + h % g_small``); a small head's rotary pair ``(i, i + hs/2)`` sits at the big head's
  pair ``(r*i, r*i + hb/2)`` with ``r = hb / hs``, whose RoPE frequency is the same. ``dense``:
  the ``r`` big dims ``r*i + t`` all compute the small value (so the per-head norms see the
  small mean square), ``k_norm`` is zero on the copies, ``q_norm`` is scaled by ``sqrt(r)``;
  ``sparse``: the copies are zero and q, k are scaled by ``sqrt(r)``, ``q_norm`` by
  ``1 / sqrt(r)``;
- what extra heads, FFN units and layers compute never reaches the residual stream.
  ``dense``: it is computed in identical pairs (value dims, units) and written with
  random column pairs ``(C, -C)``; ``sparse``: written with zero columns. Rows that must read
  nothing are random rows orthogonal to ``Q`` and ``e_d``;
- extra vocabulary entries copy the LM head row of ``REFERENCE_TOKEN`` and add a large negative
  weight on the constant channel: their logit is that token's logit minus a positive margin,
  so they can never win, and their share of a softmax is negligible.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from ddtree_cli.engine.drafter import DFlashDrafter
from ddtree_cli.engine.model_config import DraftConfig, TargetConfig, check_pair
from ddtree_cli.engine.target import Qwen3Target
from ddtree_cli.engine.weights import ModelPair
from ddtree_cli.errors import ConfigError

# Extra vocabulary entries score REFERENCE_TOKEN's logit minus MARGIN * MARGIN_RMS / rms, where
# rms is the small model's final residual rms: at least MARGIN nats while rms <= MARGIN_RMS
# (the trained target's ranges from about 5 to 22 on stdlib text).
REFERENCE_TOKEN = 0
MARGIN = 32.0
MARGIN_RMS = 256.0
# How the small model sits in the big one (docs/scaled-pair.md): ``dense`` spreads it over every
# channel and computes what must not reach the residual in cancelling pairs; ``sparse`` (the
# first construction) keeps it in the first channels with zeros elsewhere.
CONSTRUCTIONS = ("dense", "sparse")
# The final norms' weight on the constant channel; large so the LM head's weight stays small
# (float16 range), a power of two so it is exact in every dtype.
CONSTANT_NORM_WEIGHT = 256.0

DRAFTER_SOURCE = (
    "the shape of z-lab/Qwen3-8B-DFlash-b16, the DFlash authors' drafter for Qwen3-8B "
    "(github.com/z-lab/dflash), as a config derived from it records it (ZinYY/AdaFlash "
    "configs/qwen3-8b-dflash-thresh-head.json): 5 Qwen3 layers of Qwen3-8B's width (hidden "
    "4096, 32/8 heads of 128, FFN 12288, untied, vocab 151936) reading target layers "
    "[1, 9, 17, 25, 33] of 36 (the DFlash rule round(1 + i * 32 / 4)), block size 16"
)


@dataclass(frozen=True)
class Scale:
    """The big shapes. ``draft`` gives the drafter's shape and feature layers; its block size
    and mask token are the small drafter's."""

    name: str
    target: TargetConfig
    draft: DraftConfig
    source: str
    # Config fields of the real model beyond the engine's, copied into config.json.
    target_hf_extra: tuple[tuple[str, object], ...] = ()


QWEN3_8B = Scale(
    name="qwen3-8b",
    # Qwen/Qwen3-8B config.json: hidden 4096, 36 layers, 32 / 8 heads of 128, intermediate
    # 12288, vocab 151936, rms_norm_eps 1e-6, rope_theta 1e6, 40960 positions, untied.
    target=TargetConfig(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
    ),
    draft=DraftConfig(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=5,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        vocab_size=151936,
        target_layer_ids=(1, 9, 17, 25, 33),
    ),
    source="target: Qwen/Qwen3-8B config.json; drafter: " + DRAFTER_SOURCE,
    target_hf_extra=(
        ("max_window_layers", 36),
        ("use_sliding_window", False),
        ("sliding_window", None),
        ("rope_scaling", None),
        ("attention_dropout", 0.0),
    ),
)
SCALES = {QWEN3_8B.name: QWEN3_8B}


def reduced_scale(
    hidden: int = 512,
    layers: int = 8,
    intermediate: int = 1536,
    heads: int = 8,
    kv_heads: int = 2,
    head_dim: int = 128,
    draft_layers: int = 3,
    feature_layers: tuple[int, ...] = (1, 3, 5, 6),
    vocab: int = 151936,
    max_positions: int = 4096,
) -> Scale:
    """A smaller big shape built the same way (CPU tests): Qwen3-8B's vocabulary and head
    size, fewer channels and layers."""
    target = replace(
        QWEN3_8B.target,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
    )
    draft = replace(
        QWEN3_8B.draft,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=draft_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        target_layer_ids=feature_layers,
    )
    extra = (("max_window_layers", layers), *QWEN3_8B.target_hf_extra[1:])
    return Scale(f"reduced-h{hidden}-l{layers}", target, draft, "reduced (tests)", extra)


@dataclass(frozen=True)
class Residual:
    """How a small hidden vector sits in a big one: ``s * x`` in channels ``[0, d)``, the
    constant ``a`` in channel ``d``, zero elsewhere; RMSNorm weights scale by ``norm_scale``."""

    small: int
    big: int
    s: float
    k: float
    a: float

    @property
    def channel(self) -> int:
        return self.small

    @property
    def norm_scale(self) -> float:
        return math.sqrt(self.k) / self.s


def residual_layout(small: int, big: int, eps: float) -> Residual:
    """``s``: the smallest power of two with ``s**2 >= 1.25 * D / d`` (exact in bf16, and
    ``k = s**2 * d / D >= 1.25`` leaves room for the constant channel)."""
    if big < small + 1:
        raise ConfigError(f"hidden size {big} has no room for {small} channels and a constant")
    s = 1.0
    while s * s < 1.25 * big / small:
        s *= 2.0
    k = s * s * small / big
    return Residual(small, big, s, k, math.sqrt(big * eps * (k - 1.0)))


@dataclass(frozen=True)
class AttnShape:
    heads: int
    kv_heads: int
    head_dim: int


def head_map(small: AttnShape, big: AttnShape) -> tuple[torch.Tensor, torch.Tensor]:
    """Big query head per small query head, big KV head per small KV head (GQA groups kept)."""
    if small.heads % small.kv_heads or big.heads % big.kv_heads:
        raise ConfigError("query heads must be a multiple of KV heads")
    g_small, g_big = small.heads // small.kv_heads, big.heads // big.kv_heads
    if small.kv_heads > big.kv_heads or g_small > g_big:
        raise ConfigError(
            f"{small.heads}/{small.kv_heads} heads do not fit in {big.heads}/{big.kv_heads}"
        )
    q = torch.tensor([(h // g_small) * g_big + h % g_small for h in range(small.heads)])
    return q, torch.arange(small.kv_heads)


def dim_map(small: int, big: int) -> torch.Tensor:
    """Big head dimension per small one: rotate-half pair ``(i, i + small/2)`` goes to
    ``(r*i, r*i + big/2)``, whose frequency ``theta**(-2*r*i/big)`` equals the small one's."""
    if big % small or small % 2:
        raise ConfigError(f"head dim {small} must be even and divide head dim {big}")
    r, half = big // small, small // 2
    first = torch.arange(half) * r
    return torch.cat([first, first + big // 2])


def place_layers(
    small_layers: int,
    small_features: tuple[int, ...],
    big_layers: int,
    big_features: tuple[int, ...],
) -> list[int]:
    """Big layer index of each small layer, such that big feature layer ``big_features[j]``
    outputs what small feature layer ``small_features[j]`` does (the layers between are
    identities, so a big layer outputs the last small layer placed at or before it)."""
    if list(small_features) != sorted(set(small_features)):
        raise ConfigError(f"drafter target_layer_ids {list(small_features)} must increase")
    if len(big_features) < len(small_features):
        raise ConfigError(
            f"the big drafter reads {len(big_features)} layers, the small one {len(small_features)}"
        )
    anchor = dict(zip(small_features, big_features, strict=False))
    places: list[int] = []
    for i in range(small_layers):
        p = anchor.get(i, places[-1] + 1 if places else i)
        if places and p <= places[-1]:
            p = -1
        nxt = next((anchor[f] for f in small_features if f > i), big_layers)
        if not 0 <= p < nxt or p >= big_layers:
            raise ConfigError(
                f"cannot place {small_layers} layers with features {list(small_features)} "
                f"into {big_layers} layers with features {list(big_features)}"
            )
        places.append(p)
    return places


@dataclass(frozen=True)
class Basis:
    """The ``D x d`` matrix ``Q`` that carries a small hidden vector into the big residual
    stream: big channel ``c`` holds ``coef[c] * x[owner[c]]`` (``owner -1``: no small channel).
    Its columns are orthonormal with disjoint supports, so ``|Q x| = |x|`` and an elementwise
    weight on the big channels is an elementwise weight on the small ones. Channel
    ``constant`` belongs to no small channel: it holds the constant ``a``."""

    owner: torch.Tensor  # long [D]
    coef: torch.Tensor  # float32 [D]
    small: int
    constant: int

    @property
    def owned(self) -> torch.Tensor:
        return (self.owner >= 0).nonzero().flatten()

    @property
    def free(self) -> torch.Tensor:
        """Channels that are exactly zero in every residual (the sparse layout's)."""
        free = self.owner < 0
        free[self.constant] = False
        return free.nonzero().flatten()

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """``Q x`` along the last axis ([..., d] -> [..., D]); for a weight ``W`` that reads
        small vectors this is ``W Q^T``, the weight that reads their images."""
        return x[..., self.owner.clamp(min=0)] * self.coef

    def project(self, v: torch.Tensor) -> torch.Tensor:
        """``Q^T v`` along the last axis ([..., D] -> [..., d])."""
        owned = self.owned
        out = torch.zeros(*v.shape[:-1], self.small, device=v.device, dtype=v.dtype)
        return out.index_add_(-1, self.owner[owned], v[..., owned] * self.coef[owned])

    def write(self, w: torch.Tensor) -> torch.Tensor:
        """``Q W`` for a weight ``W`` [d, cols] that writes small vectors: [D, cols]."""
        return w[self.owner.clamp(min=0)] * self.coef[:, None]

    def complement(self, r: torch.Tensor) -> torch.Tensor:
        """Rows ``r`` [rows, D] less their part in ``span(Q)`` and on the constant channel:
        they read nothing of any residual (in real arithmetic)."""
        r = r - self.embed(self.project(r))
        r[:, self.constant] = 0.0
        return r


def residual_basis(
    small: int, big: int, construction: str, device: torch.device, seed: int
) -> Basis:
    """``sparse``: small channel ``i`` is big channel ``i`` (the constant channel ``d``, the
    rest zero). ``dense``: the ``D - 1`` channels other than ``d`` are dealt out at random to
    the ``d`` small channels (10 or 11 each for Qwen3-8B) with seeded Gaussian coefficients
    normalised per small channel, so every channel of the residual stream carries a value."""
    if construction not in CONSTRUCTIONS:
        raise ConfigError(f"construction {construction!r}: expected one of {list(CONSTRUCTIONS)}")
    owner = torch.full((big,), -1, dtype=torch.long)
    coef = torch.zeros(big, dtype=torch.float64)
    if construction == "sparse":
        owner[:small] = torch.arange(small)
        coef[:small] = 1.0
    else:
        gen = torch.Generator().manual_seed(seed)
        channels = torch.cat([torch.arange(small), torch.arange(small + 1, big)])
        channels = channels[torch.randperm(big - 1, generator=gen)]
        owner[channels] = torch.arange(big - 1) % small
        raw = torch.randn(big - 1, generator=gen, dtype=torch.float64)
        norm = torch.zeros(small, dtype=torch.float64).index_add_(0, owner[channels], raw * raw)
        coef[channels] = raw / norm.sqrt()[owner[channels]]
    return Basis(owner.to(device), coef.to(device, torch.float32), small, small)


class _Builder:
    """Builds big tensors (float32, on ``device``) from small ones; free weights are random.

    ``dense``: every value that must not reach the residual stream is computed twice
    (identical rows: value dims ``j`` and ``j + hb/2`` of a head, extra FFN units ``j`` and
    ``j + n/2``) and written with opposite columns ``(C, -C)``; ``sparse``: it is written with
    zero columns."""

    def __init__(self, res: Residual, basis: Basis, dense: bool, device: torch.device, seed: int):
        self.res = res
        self.basis = basis
        self.dense = dense
        self.device = device
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def random(self, shape: tuple[int, ...]) -> torch.Tensor:
        t = torch.randn(shape, generator=self.gen, device=self.device)
        return t.mul_(shape[-1] ** -0.5)

    def small(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(self.device, torch.float32)

    def norm(self, w: torch.Tensor | None, constant_weight: float = 1.0) -> torch.Tensor:
        out = torch.ones(self.res.big, device=self.device)
        if w is not None:
            owned = self.basis.owned
            out[owned] = self.small(w)[self.basis.owner[owned]] * self.res.norm_scale
        out[self.basis.constant] = constant_weight
        return out

    def fill_free(self, out: torch.Tensor) -> torch.Tensor:
        """Random values in the columns that multiply the sparse layout's zero channels."""
        free = self.basis.free
        if len(free):
            out[:, free] = self.random(tuple(out.shape))[:, free]
        return out

    def read(self, w: torch.Tensor) -> torch.Tensor:
        """Rows reading a normed hidden vector through the small weight ``w``: ``w Q^T``."""
        return self.fill_free(self.basis.embed(self.small(w)))

    def reads_nothing(self, rows: int) -> torch.Tensor:
        """Random rows that read nothing of any residual."""
        return self.basis.complement(self.random((rows, self.res.big)))

    def write(self, w: torch.Tensor) -> torch.Tensor:
        """Columns writing ``s`` times the small update ``w`` into the residual stream."""
        return self.basis.write(self.small(w)) * self.res.s

    def twins(self, start: int, end: int, groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Indices ``(first, second)`` pairing ``[start, end)`` (split in ``groups`` equal
        parts, each paired with itself) half against half: ``j`` with ``j + n/2``. Twins sit
        far apart, so no chunk of a kernel's reduction holds both halves of a pair."""
        size = (end - start) // groups
        half = torch.arange(size // 2, device=self.device)
        first = (start + size * torch.arange(groups, device=self.device)[:, None] + half).flatten()
        return first, first + size // 2

    def discard(self, cols: int, twins: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """An output projection whose columns write nothing: zero (sparse), or (dense) random
        in ``twins`` pairs ``(C, -C)`` for inputs computed identically in both, zero in the
        other columns (which a real block overwrites); the constant channel's row is zero, so
        no writer ever touches it."""
        if not self.dense:
            return torch.zeros(self.res.big, cols, device=self.device)
        first, second = twins
        out = torch.zeros(self.res.big, cols, device=self.device)
        out[:, first] = self.random((self.res.big, len(first)))
        out[:, second] = -out[:, first]
        out[self.basis.constant] = 0.0
        return out

    def layer(self, small: dict[str, torch.Tensor] | None, s_attn: AttnShape, b_attn: AttnShape,
              intermediate: int) -> dict[str, torch.Tensor]:  # fmt: skip
        """One big decoder layer (names relative to the layer); ``small=None``: an identity."""
        big, hb = self.res.big, b_attn.head_dim
        q_rows, kv_rows = b_attn.heads * hb, b_attn.kv_heads * hb
        units = 0 if small is None else small["mlp.gate_proj.weight"].shape[0]
        q = self.random((q_rows, big))
        k = self.random((kv_rows, big))
        v = self.random((kv_rows, big))
        gate = self.random((intermediate, big))
        up = self.random((intermediate, big))
        value_twins = self.twins(0, q_rows, b_attn.heads)  # dims j, j + hb/2 of every head
        unit_twins = self.twins(units, intermediate)  # the extra units
        if self.dense:  # twin rows compute identical values
            first, second = self.twins(0, kv_rows, b_attn.kv_heads)
            v[second] = v[first]
            gate[unit_twins[1]] = gate[unit_twins[0]]
            up[unit_twins[1]] = up[unit_twins[0]]
        o = self.discard(q_rows, value_twins)
        down = self.discard(intermediate, unit_twins)
        q_norm = torch.ones(hb, device=self.device)
        k_norm = torch.ones(hb, device=self.device)
        out = {
            "self_attn.q_proj.weight": q, "self_attn.k_proj.weight": k,
            "self_attn.v_proj.weight": v, "self_attn.o_proj.weight": o,
            "self_attn.q_norm.weight": q_norm, "self_attn.k_norm.weight": k_norm,
            "mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up, "mlp.down_proj.weight": down,
            "input_layernorm.weight": self.norm(None),
            "post_attention_layernorm.weight": self.norm(None),
        }  # fmt: skip
        if small is None:
            return out
        qmap, kvmap = head_map(s_attn, b_attn)
        pi = dim_map(s_attn.head_dim, hb).to(self.device)
        r = hb // s_attn.head_dim

        def at(heads: torch.Tensor, offset: int, dims: torch.Tensor = pi) -> torch.Tensor:
            # Row of (big head, big dim dims + offset) for every (small head, small dim).
            return (heads.to(self.device)[:, None] * hb + dims[None, :] + offset).flatten()

        def heads_of(heads: torch.Tensor) -> torch.Tensor:
            return (
                heads.to(self.device)[:, None] * hb + torch.arange(hb, device=self.device)
            ).flatten()

        w = {name: self.small(t) for name, t in small.items()}
        if self.dense:
            # The r dims pi + t of a small q/k dim all hold its value: the per-head mean square
            # over hb dims is the small one over hs. k keeps only dim pi (k_norm weight 0 on
            # the copies), so the score sums the small terms, sqrt(r) too small: q_norm * sqrt(r).
            # V (no RoPE) holds small dim j in dims j + t * hs, each written with 1/r of o_proj.
            v_dims = torch.arange(s_attn.head_dim, device=self.device)
            for t in range(r):
                q[at(qmap, t)] = self.read(w["self_attn.q_proj.weight"])
                k[at(kvmap, t)] = self.read(w["self_attn.k_proj.weight"])
                v[at(kvmap, t * s_attn.head_dim, v_dims)] = self.read(w["self_attn.v_proj.weight"])
                o[:, at(qmap, t * s_attn.head_dim, v_dims)] = (
                    self.write(w["self_attn.o_proj.weight"]) / r
                )
                q_norm[pi + t] = w["self_attn.q_norm.weight"] * math.sqrt(r)
                k_norm[pi + t] = w["self_attn.k_norm.weight"] if t == 0 else 0.0
        else:
            # The other dims of a mapped head are exactly zero in q and k; q and k are scaled
            # by sqrt(r) so the norms see the small mean square, and q_norm by 1 / sqrt(r).
            q[heads_of(qmap)] = self.reads_nothing(len(qmap) * hb)
            k[heads_of(kvmap)] = self.reads_nothing(len(kvmap) * hb)
            q[at(qmap, 0)] = self.read(w["self_attn.q_proj.weight"]) * math.sqrt(r)
            k[at(kvmap, 0)] = self.read(w["self_attn.k_proj.weight"]) * math.sqrt(r)
            v[at(kvmap, 0)] = self.read(w["self_attn.v_proj.weight"])
            o[:, at(qmap, 0)] = self.write(w["self_attn.o_proj.weight"])
            q_norm[pi] = w["self_attn.q_norm.weight"] / math.sqrt(r)
            k_norm[pi] = w["self_attn.k_norm.weight"]
        gate[:units] = self.read(w["mlp.gate_proj.weight"])
        up[:units] = self.read(w["mlp.up_proj.weight"])
        down[:, :units] = self.write(w["mlp.down_proj.weight"])
        out["input_layernorm.weight"] = self.norm(w["input_layernorm.weight"])
        out["post_attention_layernorm.weight"] = self.norm(w["post_attention_layernorm.weight"])
        return out


def _layer_state(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


@dataclass
class ScaledPair:
    """Configs and lazily built tensors (float32, on the build device) of a scaled pair."""

    target_config: TargetConfig
    draft_config: DraftConfig
    scale: Scale
    residual: Residual
    basis: Basis
    construction: str
    target_places: list[int]
    drafter_places: list[int]
    lm_head_constant_weight: float
    _pair: ModelPair
    _device: torch.device
    _seed: int

    def facts(self) -> dict:
        """What the manifest records about the construction."""
        per_channel = torch.bincount(
            self.basis.owner[self.basis.owned], minlength=self.residual.small
        )
        return {
            "scale": self.scale.name,
            "source": self.scale.source,
            "construction": self.construction,
            "residual": {
                "small_hidden": self.residual.small,
                "big_channels_per_small_channel": sorted({int(n) for n in per_channel}),
                "scale_s": self.residual.s,
                "k": self.residual.k,
                "constant_channel": self.residual.channel,
                "constant_value": self.residual.a,
                "norm_weight_scale": self.residual.norm_scale,
            },  # fmt: skip
            "target_layers_of_small_layers": self.target_places,
            "drafter_layers_of_small_layers": self.drafter_places,
            "extra_vocabulary": {
                "rows": f"{self._pair.target.config.vocab_size}..{self.target_config.vocab_size - 1}",
                "reference_token": REFERENCE_TOKEN,
                "margin_nats_at_or_below_rms": [MARGIN, MARGIN_RMS],
                "lm_head_constant_weight": self.lm_head_constant_weight,
            },
            "seed": self._seed,
        }

    def model_pair(
        self, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> ModelPair:
        """The engine's modules holding these tensors, allocated on ``device`` (no host copy)."""
        with torch.device(device):
            target = Qwen3Target(self.target_config).to(dtype)
            drafter = DFlashDrafter(
                self.draft_config, self.target_config.max_position_embeddings
            ).to(dtype)
        for module, tensors in ((target, self.target_tensors()), (drafter, self.draft_tensors())):
            params = dict(module.named_parameters())
            built = set()
            with torch.no_grad():
                for name, t in tensors:
                    if name not in params:
                        raise ConfigError(f"scaled tensor {name} has no parameter")
                    params[name].copy_(t)
                    built.add(name)
            missing = set(params) - built
            if missing:
                raise ConfigError(f"scaled parameters not built: {sorted(missing)[:3]}")
        return ModelPair(target.eval(), drafter.eval(), self.scale.name, "-", False)

    def _builder(self, offset: int) -> _Builder:
        dense = self.construction == "dense"
        return _Builder(self.residual, self.basis, dense, self._device, self._seed + offset)

    def target_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        b = self._builder(0)
        small = self._pair.target.state_dict()
        s_cfg, b_cfg = self._pair.target.config, self.target_config
        vs = s_cfg.vocab_size
        embed = torch.empty(b_cfg.vocab_size, b_cfg.hidden_size, device=self._device)
        embed[:vs] = self.basis.embed(b.small(small["model.embed_tokens.weight"])) * self.residual.s
        embed[vs:] = embed[REFERENCE_TOKEN]  # never looked up by the byte-level pair
        embed[:, self.basis.constant] = self.residual.a
        yield "model.embed_tokens.weight", embed
        del embed
        s_attn, b_attn = _attn(s_cfg), _attn(b_cfg)
        for i in range(b_cfg.num_hidden_layers):
            j = self.target_places.index(i) if i in self.target_places else None
            layer = None if j is None else _layer_state(small, f"model.layers.{j}.")
            tensors = b.layer(layer, s_attn, b_attn, b_cfg.intermediate_size)
            for name, t in tensors.items():
                yield f"model.layers.{i}.{name}", t
        yield "model.norm.weight", b.norm(small["model.norm.weight"], CONSTANT_NORM_WEIGHT)
        head = small.get("lm_head.weight", small["model.embed_tokens.weight"])
        out = torch.empty(b_cfg.vocab_size, b_cfg.hidden_size, device=self._device)
        out[:vs] = b.read(head)
        # Extra rows: the reference row plus random rows that read nothing, and the margin.
        out[vs:] = b.reads_nothing(b_cfg.vocab_size - vs)
        out[vs:] += self.basis.embed(b.small(head[REFERENCE_TOKEN]))
        out[vs:, self.basis.constant] = self.lm_head_constant_weight
        yield "lm_head.weight", out

    def draft_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        b = self._builder(1)
        small = self._pair.drafter.state_dict()
        s_cfg, b_cfg = self._pair.drafter.config, self.draft_config
        d, big = s_cfg.hidden_size, b_cfg.hidden_size
        slots_small, slots_big = len(s_cfg.target_layer_ids), len(b_cfg.target_layer_ids)
        # fc reads [slot, channel]; inputs are big residuals s*Q*f + a*e_c, output likewise:
        # slot j < slots_small maps them by Q W_j Q^T, the other slots read nothing.
        fc = torch.empty(big, slots_big, big, device=self._device)
        w = b.small(small["fc.weight"]).view(d, slots_small, d)
        for j in range(slots_big):
            if j < slots_small:
                fc[:, j] = b.fill_free(self.basis.write(self.basis.embed(w[:, j])))
            else:
                fc[:, j] = b.reads_nothing(big)
        fc[self.basis.constant] = 0.0
        fc[self.basis.constant, 0, self.basis.constant] = 1.0
        yield "fc.weight", fc.view(big, slots_big * big)
        del fc
        yield "hidden_norm.weight", b.norm(small["hidden_norm.weight"])
        s_attn, b_attn = _attn(s_cfg), _attn(b_cfg)
        for i in range(b_cfg.num_hidden_layers):
            j = self.drafter_places.index(i) if i in self.drafter_places else None
            layer = None if j is None else _layer_state(small, f"layers.{j}.")
            for name, t in b.layer(layer, s_attn, b_attn, b_cfg.intermediate_size).items():
                yield f"layers.{i}.{name}", t
        yield "norm.weight", b.norm(small["norm.weight"], CONSTANT_NORM_WEIGHT)


def _attn(cfg: TargetConfig | DraftConfig) -> AttnShape:
    return AttnShape(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)


def scale_pair(
    pair: ModelPair,
    scale: Scale,
    device: str | torch.device = "cpu",
    seed: int = 0,
    construction: str = "dense",
) -> ScaledPair:
    """Check that ``pair`` fits ``scale`` and plan the scaled pair (tensors come lazily).
    ``construction``: ``dense`` (the default) or ``sparse`` (the first one, kept to compare
    costs; docs/scaled-pair.md)."""
    st, sd = pair.target.config, pair.drafter.config
    bt = scale.target
    bd = replace(scale.draft, block_size=sd.block_size, mask_token_id=sd.mask_token_id)
    check_pair(bt, bd)
    if bt.tie_word_embeddings:
        raise ConfigError(f"scale {scale.name}: the scaled target needs an untied LM head")
    for what, small, big in (
        ("rms_norm_eps", st.rms_norm_eps, bt.rms_norm_eps),
        ("rms_norm_eps", sd.rms_norm_eps, bd.rms_norm_eps),
        ("rope_theta", st.rope_theta, bt.rope_theta),
        ("rope_theta", sd.rope_theta, bd.rope_theta),
    ):
        if small != big:
            raise ConfigError(f"scale {scale.name}: {what} {big} differs from the pair's {small}")
    for what, small, big in (
        ("vocabulary", st.vocab_size, bt.vocab_size),
        ("target layers", st.num_hidden_layers, bt.num_hidden_layers),
        ("drafter layers", sd.num_hidden_layers, bd.num_hidden_layers),
        ("target FFN", st.intermediate_size, bt.intermediate_size),
        ("drafter FFN", sd.intermediate_size, bd.intermediate_size),
        ("positions", st.max_position_embeddings, bt.max_position_embeddings),
    ):
        if small > big:
            raise ConfigError(
                f"scale {scale.name}: {what} {big} is smaller than the pair's {small}"
            )
    if st.hidden_size != sd.hidden_size:
        raise ConfigError("the pair's drafter and target differ in hidden size")
    head_map(_attn(st), _attn(bt))
    head_map(_attn(sd), _attn(bd))
    dim_map(st.head_dim, bt.head_dim)
    dim_map(sd.head_dim, bd.head_dim)
    res = residual_layout(st.hidden_size, bt.hidden_size, bt.rms_norm_eps)
    target_places = place_layers(
        st.num_hidden_layers, sd.target_layer_ids, bt.num_hidden_layers, bd.target_layer_ids
    )
    drafter_places = list(range(sd.num_hidden_layers))
    # Extra logit = reference logit + w_c * (CONSTANT_NORM_WEIGHT * a / (sqrt(k) * rms)).
    w_c = -MARGIN * MARGIN_RMS * math.sqrt(res.k) / (CONSTANT_NORM_WEIGHT * res.a)
    device = torch.device(device)
    basis = residual_basis(st.hidden_size, bt.hidden_size, construction, device, seed)
    return ScaledPair(bt, bd, scale, res, basis, construction, target_places, drafter_places,
                      w_c, pair, device, seed)  # fmt: skip
