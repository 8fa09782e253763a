"""SpecLens's own float32 CPU kernels (engine/runtime/native_kernels.cpp), compiled for this CPU at first use:
a linear layer and attention over the KV cache.

Decoding a small model on a CPU streams every weight from memory once per forward. PyTorch's kernels
reach only part of the memory bandwidth for one row: on two cores of an AMD EPYC the default model's
211 linear layers took 27-33 ms per one-row forward on oneDNN's packed kernel and 35-46 ms on stock
`F.linear`, against 13-20 ms here; blocks of 9-13 rows (a draft tree being verified) took 23-32 ms
here and 26-44 ms on oneDNN (a scratch benchmark of those shapes with cold weights, medians and minima
over interleaved runs; the machine was shared). Plain and speculative decoding run the same
kernels, so the baseline gets the speed-up too.

Both kernels are batch invariant: each output is one chain of operations in a fixed order over the
input (for attention, over the keys a query may see, in cache order), so a row's result is bit for
bit the same alone or inside a block or tree of any size, and with both a whole forward is (tests
check this). Verification then scores a drafted token with exactly plain decoding's numbers.

They are built with torch.utils.cpp_extension (a C++ compiler and ninja) into the SpecLens cache,
keyed by the source, the torch build and this CPU, so later starts load them in a second. Where they
cannot be built (no compiler, another architecture, a CPU without AVX2 and FMA) or fail their
self-check, SpecLens says why (`speclens doctor`) and uses PyTorch's kernels (engine/runtime/cpu_kernels.py,
engine/runtime/attention.py). SPECLENS_NATIVE_KERNELS=0 turns them off; SPECLENS_NATIVE_ISA=avx2 builds them
without AVX-512 on a CPU that has it (to test or measure the AVX2 path, which most laptops run).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from speclens.engine.runtime.paths import cache_dir

SOURCE = Path(__file__).with_name("native_kernels.cpp")
LDFLAGS = ("-fopenmp",)
ISA_FLAGS = {"native": (), "avx2": ("-mno-avx512f",)}  # SPECLENS_NATIVE_ISA: extra flags to -march=native


def isa_choice() -> str:
    return os.environ.get("SPECLENS_NATIVE_ISA", "native").lower()


def cflags() -> tuple[str, ...]:
    return ("-O3", "-march=native", *ISA_FLAGS.get(isa_choice(), ()), "-fopenmp")


@dataclass(frozen=True)
class NativeBuild:
    module: object | None  # the compiled extension, or None
    message: str  # what was built, or why nothing was
    integer: str = ""  # the instruction set of its integer kernels where they passed their check, else ""
    integer_message: str = ""  # why the integer kernels are not used, when they are not


def _cpu_signature() -> str:
    """What a -march=native build depends on: the CPU model and its instruction-set flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def build_name() -> str:
    """The extension's name: a digest of everything the compiled file depends on."""
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), sys.version.encode(), _cpu_signature().encode(),
                 " ".join(cflags() + LDFLAGS).encode()):
        digest.update(part)
    return f"speclens_{isa_choice()}_{digest.hexdigest()[:16]}"


def build_dir() -> Path:

    return cache_dir() / "kernels" / build_name()


def unsupported_reason() -> str | None:
    """Why this machine cannot use the native kernel, or None if it can try to build it."""
    if os.environ.get("SPECLENS_NATIVE_KERNELS", "1") == "0":
        return "turned off (SPECLENS_NATIVE_KERNELS=0)"
    if isa_choice() not in ISA_FLAGS:
        return f"SPECLENS_NATIVE_ISA={isa_choice()} is not one of {', '.join(ISA_FLAGS)}"
    if not SOURCE.exists():
        return f"its source {SOURCE.name} is missing from this installation"
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return f"built for Linux on x86-64 only, not {platform.system()} on {platform.machine()}"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"this CPU lacks AVX2 and FMA (PyTorch reports {capability})"
    return None


def _find_ninja() -> None:
    """torch's builder runs `ninja` from PATH; a virtual environment that was not activated has the
    ninja package's binary (a dependency) outside it."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def is_built() -> bool:
    """Whether a build for this machine is already in the cache (loading it takes about a second)."""
    return unsupported_reason() is None and build_dir().exists() and any(build_dir().glob("*.so"))


@functools.cache  # one build per process: later calls return the loaded module
def native_build() -> NativeBuild:
    """Build (or load from the cache) and self-check the kernel; never raises."""
    reason = unsupported_reason()
    if reason:
        return NativeBuild(None, reason)
    try:
        import fcntl  # POSIX only, as the kernels are (unsupported_reason)

        _find_ninja()
        folder = build_dir()
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder.with_suffix(".lock"), "w") as guard:
            # torch's builder waits, forever, for its `lock` file to go; a build that was killed (the
            # app closed during its first start) leaves one behind. An flock dies with its process, so
            # once this one is ours, no live build is running and a `lock` file left here is stale.
            fcntl.flock(guard, fcntl.LOCK_EX)
            (folder / "lock").unlink(missing_ok=True)
            try:
                module = _load(folder)
            except Exception:  # noqa: BLE001 - a damaged build (a truncated library) is redone once
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir(parents=True)
                module = _load(folder)
    except Exception as exc:  # noqa: BLE001 - compilers fail in many ways; the app must go on without
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        return NativeBuild(None, f"could not be built here ({first}); PyTorch's kernels are used")
    _remove_older_builds(folder)
    problem = self_check(module)
    if problem:
        return NativeBuild(None, f"failed its self-check ({problem}); PyTorch's kernels are used")
    message = (f"{module.isa()} float32 linear (Q4_1- and Q8_0-style weights as 4-bit and 8-bit blocks) and "
               f"attention, built for this CPU in {build_dir()}")
    integer_problem = integer_self_check(module)
    if integer_problem:
        return NativeBuild(module, message, "", f"the integer kernels failed their self-check ({integer_problem})")
    return NativeBuild(module, message, module.integer_isa())


def quantize_q8(x: torch.Tensor) -> torch.Tensor:
    """What the integer kernels make of activations x [M, K]: per row and block of 32 inputs,
    round(x * 127 / max|x|) times max|x| / 127 (the reference of integer_self_check and the tests)."""
    blocks = x.view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inverse) * (amax / 127)).view_as(x)


def quantize_q16(x: torch.Tensor) -> torch.Tensor:
    """What the integer kernels make of activations with 16-bit activations (NativeLinear.residual): the
    Q8 blocks of x plus the Q8 blocks of what their rounding left."""
    blocks = x.view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    q = torch.round(blocks * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax)))
    d = amax / 127
    # what was left, rounded once as the kernel's fma(-d, q, x) does: x - q d in float32 would round the
    # product first and could move a residual across a rounding boundary
    rest = (blocks.double() - q.double() * d.double()).float().view_as(x)
    return (q * d).view_as(x) + quantize_q8(rest)


def integer_self_check(module) -> str | None:
    """The integer kernels over Q4_1- and Q8_0-style blocks against float64 products of the quantised
    activations (quantize_q8; quantize_q16 for 16-bit ones) with the exact weights, on every tile size and a
    ragged panel; None if
    they agree and each row of a block equals the row computed alone, bit for bit; else what went wrong."""
    generator = torch.Generator().manual_seed(1)
    scale = (torch.rand(100, 3, 1, generator=generator) * 0.02 + 1e-3).half().float()
    low = (-torch.rand(100, 3, 1, generator=generator) * 0.1).half().float()
    levels = torch.randint(0, 16, (100, 3, 32), generator=generator).float()
    levels[..., 0], levels[..., 1] = 0, 15
    signed = torch.randint(-127, 128, (100, 3, 32), generator=generator).float()
    signed[..., 0] = 127
    for name, pack_kind, weight in (("4-bit", pack_blocks, torch.addcmul(low, scale, levels).view(100, 96)),
                                    ("8-bit", pack_byte_blocks, (scale * signed).view(100, 96))):
        blocks = pack_kind(weight, integer=True)
        if blocks is None:
            return f"{name} blocks could not be packed"
        for rows, residual in ((1, False), (5, False), (16, False), (17, False), (33, False), (1, True), (9, True)):
            x = torch.randn(rows, 96, generator=generator)
            what = f"{rows} rows over {name} blocks" + (" (16-bit activations)" if residual else "")
            try:
                got = module.linear(x, blocks, None, 100, residual)
            except RuntimeError as exc:
                return str(exc).splitlines()[0][:120]
            want = (quantize_q16 if residual else quantize_q8)(x).double() @ weight.double().T
            if (got.double() - want).abs().max().item() > 1e-4:
                return f"{what} differ from the quantised product"
            alone = torch.cat([module.linear(x[i : i + 1], blocks, None, 100, residual) for i in range(rows)])
            if not torch.equal(got, alone):
                return f"a block of {what} differs from its rows one at a time"
    return None


def _remove_older_builds(current: Path) -> None:
    """Builds for an earlier source, torch or CPU (a few MB each) are left by upgrades: drop them (those of
    the same instruction-set choice only: an AVX2 build made for testing leaves the native one alone)."""
    prefix = current.name.rsplit("_", 1)[0]
    for other in current.parent.glob(f"{prefix}_*"):
        if other.name not in (current.name, current.name + ".lock"):
            if other.is_dir():
                shutil.rmtree(other, ignore_errors=True)
            else:
                other.unlink(missing_ok=True)


def _load(folder: Path):
    from torch.utils.cpp_extension import load

    return load(build_name(), [str(SOURCE)], extra_cflags=list(cflags()), extra_ldflags=list(LDFLAGS),
                build_directory=str(folder), verbose=False)


def self_check(module) -> str | None:
    """Compare the linear kernel with F.linear on shapes that cover every tile and tail, with float32 and
    bfloat16 panels (and 4-bit and 8-bit blocks with float32 panels), and the attention kernel with softmax
    attention; None if they agree and each row of a block equals the row computed alone, bit for bit;
    else what went wrong."""
    generator = torch.Generator().manual_seed(0)
    for out_features, in_features, bias in ((48, 32, False), (200, 96, True), (64, 576, False)):
        weight = torch.randn(out_features, in_features, generator=generator)  # [N, K]
        b = torch.randn(out_features, generator=generator) if bias else None
        for bfloat16 in (False, True):
            panels = module.pack(weight, bfloat16)
            exact = (weight.bfloat16() if bfloat16 else weight).double()  # the weights the panels hold
            for rows in (1, 5, 9, 13, 30):
                x = torch.randn(rows, in_features, generator=generator)  # [rows, K]
                got = module.linear(x, panels, b, out_features)
                want = nn.functional.linear(x.double(), exact, None if b is None else b.double())
                if got.shape != want.shape or (got.double() - want).abs().max().item() > 1e-4 * in_features ** 0.5:
                    return f"{rows} rows of a {out_features}x{in_features} weight differ from F.linear"
                alone = torch.cat([module.linear(x[i : i + 1], panels, b, out_features) for i in range(rows)])
                if not torch.equal(got, alone):
                    return f"a block of {rows} rows differs from its rows computed one at a time"
    # a Q4_1-style weight (m + d q per 32 inputs) as 4-bit blocks and a Q8_0-style one (d q) as 8-bit
    # blocks must give the float32 panels' bits
    scale = (torch.rand(100, 3, 1, generator=generator) * 0.02 + 1e-3).half().float()
    low = (-torch.rand(100, 3, 1, generator=generator) * 0.1).half().float()
    levels = torch.randint(0, 16, (100, 3, 32), generator=generator).float()
    levels[..., 0], levels[..., 1] = 0, 15
    signed = torch.randint(-127, 128, (100, 3, 32), generator=generator).float()
    signed[..., 0] = 127
    for name, pack_kind, weight in (("4-bit", pack_blocks, torch.addcmul(low, scale, levels).view(100, 96)),
                                    ("8-bit", pack_byte_blocks, (scale * signed).view(100, 96))):
        blocks = pack_kind(weight)
        for rows in (1, 5, 9, 13, 30):
            x = torch.randn(rows, 96, generator=generator)
            if blocks is None or not torch.equal(module.linear(x, blocks, None, 100),
                                                 module.linear(x, module.pack(weight, False), None, 100)):
                return f"{rows} rows over {name} blocks differ from the same weight's float32 panels"
    return _attention_problem(module, generator)


def _attention_problem(module, generator: torch.Generator) -> str | None:
    """The attention kernel against float64 softmax attention, with a mask that skips keys between
    the ones a query sees; and each query of the block against itself alone over just its keys."""
    q = torch.randn(5, 6, 64, generator=generator)  # [T, H, D]: 6 query heads over 2 key/value heads
    k, v = torch.randn(2, 2, 37, 64, generator=generator)  # [G, S, D] each
    allowed = torch.rand(5, 37, generator=generator) < 0.7  # [T, S]
    allowed[:, 0] = True
    got = module.attention(q, k, v, allowed, 0.125, True)  # [T, H, D]
    for t in range(5):
        keys = torch.nonzero(allowed[t])[:, 0]
        for h in range(6):
            weights = (q[t, h].double() @ k[h // 3, keys].double().T * 0.125).softmax(-1)
            if (got[t, h].double() - weights @ v[h // 3, keys].double()).abs().max().item() > 1e-5:
                return "attention differs from softmax attention"
        if not torch.equal(got[t], module.attention(q[t : t + 1], k[:, keys], v[:, keys], None, 0.125, True)[0]):
            return "a masked query's attention differs from the same query over just its keys"
    return None


def native_module(progress: Callable[[str, float | None], None] | None = None):
    """The loaded extension, or None; reports a first build (tens of seconds) through `progress`."""
    if progress is not None and native_build.cache_info().currsize == 0 and not unsupported_reason() and not is_built():
        progress("Compiling SpecLens's CPU kernels for this machine (once, about a minute)", None)
    return native_build().module


def pack_blocks(weight: torch.Tensor, integer: bool = False) -> torch.Tensor | None:
    """float32 [N, K] -> the native linear's 4-bit blocks, uint8 [P, K / 32, 320] (P = N rounded up to 64,
    over 16), if every 32 consecutive inputs of each output hold m + d * q exactly, with m and d half
    precision and q = 0..15 (what a Q4_1 GGUF dequantises to); else None. Checked weight by weight, so
    the kernel's rebuilt weights, and so its outputs, are bit for bit the float32 ones.

    Layout (engine/runtime/native_kernels.cpp): per panel of 16 outputs and block of 32 inputs, the 16 d and the
    16 m in half precision, then per pair of inputs 2i, 2i + 1 16 bytes, byte j holding output j's q for
    input 2i (low nibble) and 2i + 1 (high nibble).

    integer=True: the integer kernel's layout, uint8 [P, K / 32, 5, 64]: the same d and m, then four
    64-byte vectors v whose lane j (4 bytes b) holds output j's q for input 4v + b (low nibble) and
    16 + 4v + b (high nibble): the 4 consecutive inputs one vpdpbusd lane multiplies."""
    blocks = _blocks_of_32(weight)
    if blocks is None:
        return None
    low = blocks.amin(-1, keepdim=True)  # [N', B, 1]: m is the smallest weight (q = 0)
    if not torch.equal(low.half().float(), low):
        return None
    # d is (max - min) / 15 to half precision, give or take the rounding of the quantiser
    found = _exact_levels(blocks, low, (blocks.amax(-1, keepdim=True) - low) / 15, (0, -1, 1, -2, 2), 0, 15)
    if found is None:
        return None
    d, q = found
    panels, per = blocks.shape[0] // 16, blocks.shape[1]
    q = q.to(torch.uint8).view(panels, 16, per, 32).permute(0, 2, 3, 1)  # [P, B, 32 inputs, 16 outputs]
    if integer:
        nibbles = (_lanes_of_four(q[:, :, :16]) | (_lanes_of_four(q[:, :, 16:]) << 4)).reshape(panels, per, 256)
        return torch.cat([_per_column(d), _per_column(low), nibbles], dim=-1).view(panels, per, 5, 64).contiguous()
    nibbles = (q[:, :, 0::2] | (q[:, :, 1::2] << 4)).reshape(panels, per, 256)  # inputs 2i, 2i + 1 share a byte
    return torch.cat([_per_column(d), _per_column(low), nibbles], dim=-1).contiguous()  # [P, B, 320]


def pack_byte_blocks(weight: torch.Tensor, integer: bool = False) -> torch.Tensor | None:
    """float32 [N, K] -> the native linear's 8-bit blocks, int8 [P, K / 32, 544], if every 32 consecutive
    inputs of each output hold d * q exactly, with d half precision and q = -128..127 (what a Q8_0 GGUF
    dequantises to: the embedded default's tied LM head); else None. d * q needs 19 bits, so the
    kernel's rebuilt weights are the float32 ones and its outputs those of the float32 panels.

    Layout: per panel of 16 outputs and block of 32 inputs, the 16 d in half precision, then per input
    the 16 outputs' q. integer=True: the integer kernel's, uint8 [P, K / 32, 17, 32]: the d, then eight
    64-byte vectors v whose lane j holds output j's q (signed bytes) for inputs 4v .. 4v + 3."""
    blocks = _blocks_of_32(weight)
    if blocks is None:
        return None
    # d is max |w| / 127 to half precision, give or take the rounding of the quantiser
    zero = torch.zeros_like(blocks[..., :1])  # [N', B, 1]
    found = _exact_levels(blocks, zero, blocks.abs().amax(-1, keepdim=True) / 127, (0, -1, 1), -128, 127)
    if found is None:
        return None
    d, q = found
    panels, per = blocks.shape[0] // 16, blocks.shape[1]
    q = q.to(torch.int8).view(panels, 16, per, 32).permute(0, 2, 3, 1)  # [P, B, 32 inputs, 16 outputs]
    if integer:
        lanes = _lanes_of_four(q).reshape(panels, per, 512).view(torch.uint8)
        return torch.cat([_per_column(d), lanes], dim=-1).view(panels, per, 17, 32).contiguous()
    q = q.reshape(panels, per, 512)  # [P, B, 32 x 16]
    return torch.cat([_per_column(d).view(torch.int8), q], dim=-1).contiguous()  # [P, B, 544]


def round_to_q8_0(weight: torch.Tensor) -> torch.Tensor | None:
    """float32 [N, K] -> the nearest Q8_0-style weight (per 32 inputs d * q, d = max |w| / 127 in half
    precision, q = round(w / d)), which pack_byte_blocks packs as 8-bit blocks; None if K is not a
    multiple of 32. For drafters on integer kernels: a drafter's precision never touches exactness."""
    n, k = weight.shape
    if k % 32:
        return None
    blocks = weight.detach().float().reshape(n, k // 32, 32)
    d = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()  # [N, K / 32, 1]
    q = torch.where(d > 0, torch.round(blocks / d), torch.zeros_like(blocks)).clamp(-127, 127)
    return (d * q).reshape(n, k).contiguous()


def _blocks_of_32(weight: torch.Tensor) -> torch.Tensor | None:
    """float32 [N, K] -> [N', B, 32]: N zero padded to a multiple of 64, the inputs in blocks of 32
    (None if K is not a multiple of 32)."""
    n, k = weight.shape
    if k % 32 or n == 0:
        return None
    padded = (n + 63) // 64 * 64
    full = weight.new_zeros(padded, k)
    full[:n] = weight
    return full.view(padded, k // 32, 32)


def _exact_levels(blocks: torch.Tensor, base: torch.Tensor, estimate: torch.Tensor, steps: tuple[int, ...],
                  lowest: int, highest: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per block a half-precision d and integer levels q in [lowest, highest] with base + d * q equal to
    the block exactly: blocks [N', B, 32], base and estimate (of d) [N', B, 1] -> (d [N', B, 1],
    q [N', B, 32]) as floats. Tries the halves `steps` ulps from the estimate, in order; None if some
    block fits none, or most fit not even the estimate itself (the weight is not this quantiser's: a
    single pass then decides)."""
    nearest = estimate.half().view(torch.int16)  # [N', B, 1]

    def trial(step: int, part: torch.Tensor, offset: torch.Tensor, bits: torch.Tensor):
        d = (bits + step).view(torch.float16).float()  # [n, 1]
        q = torch.where(d > 0, torch.round((part - offset) / d), torch.zeros_like(part)).clamp(lowest, highest)
        return d, q, (torch.addcmul(offset, d, q) == part).all(-1)  # [n, 1], [n, 32], [n]

    # the first trial over every block at once (no indexing: a whole LM head is 900k blocks), then
    # the neighbours over just the blocks still without an exact fit
    d, q, exact = trial(steps[0], blocks, base, nearest)
    if exact.all():
        return d, q
    if exact.float().mean() < 0.5:
        return None
    for step in steps[1:]:
        todo = (~exact).nonzero()  # [n, 2]
        rows, cols = todo[:, 0], todo[:, 1]
        d_t, q_t, fits = trial(step, blocks[rows, cols], base[rows, cols], nearest[rows, cols])
        d[rows[fits], cols[fits]] = d_t[fits]
        q[rows[fits], cols[fits]] = q_t[fits]
        exact[rows[fits], cols[fits]] = True
        if exact.all():
            return d, q
    return None


def _lanes_of_four(q: torch.Tensor) -> torch.Tensor:
    """[P, B, 4n inputs, 16 outputs] -> [P, B, n, 64]: vector v, lane j, byte b = output j's input 4v + b."""
    panels, per, inputs = q.shape[:3]
    return q.view(panels, per, inputs // 4, 4, 16).transpose(3, 4).reshape(panels, per, inputs // 4, 64)


def _per_column(x: torch.Tensor) -> torch.Tensor:
    """[N', B, 1] one value per output and block -> [P, B, 32]: per panel the bytes of its 16 halves."""
    padded, per = x.shape[:2]
    return x.view(padded // 16, 16, per).transpose(1, 2).contiguous().half().view(torch.uint8)


class NativeLinear(nn.Module):
    """y = x W^T + b on SpecLens's native kernel (float32 activations, CPU inference only).

    The weight is held as float32 panels; as 4-bit blocks where it is exactly a Q4_1-style weight
    (pack_blocks: 5 bits a weight to stream instead of 32, the same outputs bit for bit); as 8-bit
    blocks where it is exactly a Q8_0-style one (pack_byte_blocks: 8.5 bits, likewise); or as bfloat16
    panels for drafters (`bfloat16`: half the bytes to stream, widened exactly to float32 in the kernel;
    a drafter's precision never touches exactness). `weight` stays reachable only where other code
    reads it (`keep_weight`: the output embedding, whose rows EAGLE drafts from and which training
    reads); elsewhere only the panels are held."""

    def __init__(self, module, weight: torch.Tensor, bias: torch.Tensor | None, keep_weight: bool = False,
                 bfloat16: bool = False, integer: bool = False, residual: bool = False):
        super().__init__()
        self.kernel = module
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        weight32 = weight.detach().float().contiguous()
        blocks = None
        if not bfloat16:
            blocks = pack_blocks(weight32, integer)
            blocks = pack_byte_blocks(weight32, integer) if blocks is None else blocks
        self.panels = module.pack(weight32, bfloat16) if blocks is None else blocks  # not a parameter
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        self.weight = weight if keep_weight else None
        # integer layouts: 16-bit activations, each row quantised twice (its 8-bit blocks, then what their
        # rounding left): top-1 agreement with float32 near 100% for twice the integer work a row
        self.residual = residual and self.integer

    @property
    def integer(self) -> bool:
        """Whether this linear runs the integer kernel (its blocks are in the integer layout)."""
        return self.panels.dim() == 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError("NativeLinear has no backward: train with stock kernels (cpu_kernels='stock')")
        return self.kernel.linear(x.float(), self.panels, self.bias, self.out_features, self.residual)

    def extra_repr(self) -> str:
        weights = {torch.uint8: "4-bit block", torch.int8: "8-bit block"}.get(
            self.panels.dtype, str(self.panels.dtype).removeprefix("torch."))
        if self.integer:
            weights = (("4-bit" if self.panels.shape[2] == 5 else "8-bit") + " block weights, "
                       + ("16-bit activations" if self.residual else "8-bit activations"))
            return f"in_features={self.in_features}, out_features={self.out_features}, kernel=native integer ({weights})"
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel=native ({weights} weights)"


def use_native_linears(module: nn.Module, native, keep: tuple[nn.Module, ...] = (), bfloat16: bool = False,
                       integer: bool = False, residual: bool = False) -> int:
    """Swap every float32 CPU nn.Linear under module for a NativeLinear on the extension `native`
    (bfloat16 panels if asked; the integer kernel's layout for Q4_1/Q8_0-style weights if `integer`, with
    16-bit activations if `residual`); linears in `keep` retain their weight attribute. Returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if type(child) is nn.Linear and child.weight.device.type == "cpu" and child.weight.dtype == torch.float32:
            setattr(module, name, NativeLinear(native, child.weight, child.bias, child in keep, bfloat16, integer,
                                               residual))
            count += 1
        else:
            count += use_native_linears(child, native, keep, bfloat16, integer, residual)
    return count
