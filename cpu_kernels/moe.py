"""Fused MoE for one layer on the CPU: packed expert weights, the C++ kernel call, and its torch reference."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from cpu_kernels import _C
from cpu_kernels.pack import (
    INT4_GROUP,
    ROWS,
    Format,
    PackedMatrix,
    check_int4_group,
    fp8_flag_bytes,
    pack_matrix,
    padded_k,
    tile_bytes,
    unpack_matrix,
)
from cpu_kernels.thread_pool import POOL_SPIN_US, pool_layout, start_torch_threads

ISA_GENERIC, ISA_AVX512_BF16, ISA_AVX2, ISA_AMX, ISA_AVX512, ISA_AVX512_VNNI = 0, 1, 2, 3, 4, 5
ISA_NAMES = {"generic": ISA_GENERIC, "avx2": ISA_AVX2, "avx512": ISA_AVX512, "avx512_vnni": ISA_AVX512_VNNI,
             "avx512_bf16": ISA_AVX512_BF16, "amx": ISA_AMX}


@lru_cache(maxsize=1)
def kernel_isa() -> int:
    """The instruction set the kernels use: the best this CPU has, or
    HYBRIDD_KERNEL_ISA=generic|avx2|avx512|avx512_vnni|avx512_bf16|amx where the CPU has it (read once). amx is the
    avx512_bf16 path with AMX tiles for many-token blocks."""
    asked = os.environ.get("HYBRIDD_KERNEL_ISA", "").lower()
    if asked:
        if asked not in ISA_NAMES:
            raise ValueError(f"HYBRIDD_KERNEL_ISA must be one of {sorted(ISA_NAMES)}, got {asked!r}")
        if not _C.isa_supported(ISA_NAMES[asked]):
            raise ValueError(f"HYBRIDD_KERNEL_ISA={asked}: this CPU lacks the instructions it needs")
        return ISA_NAMES[asked]
    return _C.best_isa()


def resolve_isa(isa: int | None) -> int:
    """`isa` where a caller chose a path, else the kernels' own (kernel_isa)."""
    return kernel_isa() if isa is None else isa


def kernel_isa_name() -> str:
    return _C.isa_name(kernel_isa())


@dataclass
class PackedExperts:
    """All experts of one layer, leading dim = expert: w13 interleaves gate and up tiles (tile 2t = gate rows
    16t.., 2t + 1 = up rows 16t..), w2 is down. data [E, tiles, tile_bytes] uint8; scales/comp/flags per tile
    (fp8 needs its flags)."""

    fmt: Format
    hidden: int
    inter: int
    kp13: int
    kp2: int
    w13_data: torch.Tensor
    w2_data: torch.Tensor
    w13_scales: torch.Tensor | None = None
    w2_scales: torch.Tensor | None = None
    w13_comp: torch.Tensor | None = None
    w2_comp: torch.Tensor | None = None
    w13_flags: torch.Tensor | None = None
    w2_flags: torch.Tensor | None = None
    block_k: int = 128
    group: int = INT4_GROUP

    def __post_init__(self) -> None:
        tiles13, tiles2 = -(-self.inter // ROWS) * 2, -(-self.hidden // ROWS)
        if self.w13_data.shape[:2] != (self.num_experts, tiles13) or self.w2_data.shape[:2] != (self.num_experts,
                                                                                               tiles2):
            raise ValueError(f"packed experts have tiles {tuple(self.w13_data.shape[:2])} / "
                             f"{tuple(self.w2_data.shape[:2])}, expected ({self.num_experts}, {tiles13}) / "
                             f"({self.num_experts}, {tiles2})")
        for t in self._tensors():
            if not t.is_contiguous():
                raise ValueError("packed expert tensors must be contiguous")
        if self.fmt == Format.INT4:
            check_int4_group(self.group)
        elif self.fmt == Format.FP8:
            if self.block_k <= 0 or self.block_k % ROWS:
                raise ValueError(f"fp8 block size along K must be a positive multiple of 16, got {self.block_k}")
            for name, flags, data, kp in (("w13", self.w13_flags, self.w13_data, self.kp13),
                                          ("w2", self.w2_flags, self.w2_data, self.kp2)):
                want = (*data.shape[:2], fp8_flag_bytes(kp))
                if flags is None or flags.shape != want or flags.dtype != torch.uint8:
                    raise ValueError(f"fp8 {name} needs its line pair flags, uint8 {want}")
        for name, k, kp, data in (("w13", self.hidden, self.kp13, self.w13_data), ("w2", self.inter, self.kp2,
                                                                                  self.w2_data)):
            want = padded_k(self.fmt, k, self.block_k, self.group)
            if kp != want or data.shape[2:] != (tile_bytes(self.fmt, kp, self.group),):
                raise ValueError(f"packed {name} has K {kp} and tiles of {tuple(data.shape[2:])} bytes, expected "
                                 f"K {want} and {tile_bytes(self.fmt, want, self.group)} for {self.fmt.name}")
        self.layer = _C.ExpertLayer(
            int(self.fmt), self.num_experts, self.hidden, self.inter, self.block_k, self.group,
            _matrices(self.w13_data, self.w13_scales, self.w13_comp, self.w13_flags, self.kp13),
            _matrices(self.w2_data, self.w2_scales, self.w2_comp, self.w2_flags, self.kp2),
        )

    def _tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.w13_data, self.w2_data, self.w13_scales, self.w2_scales, self.w13_comp,
                            self.w2_comp, self.w13_flags, self.w2_flags) if t is not None]

    @property
    def num_experts(self) -> int:
        return self.w13_data.shape[0]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def expert_bytes(self) -> int:
        """Bytes of one expert's weights and scales: what a token routed to it makes the kernel read."""
        return self.nbytes() // self.num_experts


def _matrices(data: torch.Tensor, scales: torch.Tensor | None, comp: torch.Tensor | None,
              flags: torch.Tensor | None, kp: int):
    ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    stride = lambda t: 0 if t is None else t[0].numel()  # noqa: E731
    return _C.PackedMatrices(data.data_ptr(), data[0].numel(), ptr(scales), stride(scales), ptr(comp), stride(comp),
                             ptr(flags), stride(flags), data.shape[1], kp)


def _stack(mats: list[PackedMatrix], attr: str) -> torch.Tensor | None:
    first = getattr(mats[0], attr)
    return None if first is None else torch.stack([getattr(m, attr) for m in mats])


def pack_experts(gate: list[torch.Tensor], up: list[torch.Tensor], down: list[torch.Tensor], fmt: Format | str,
                 *, gate_scale: list[torch.Tensor] | None = None, up_scale: list[torch.Tensor] | None = None,
                 down_scale: list[torch.Tensor] | None = None, block: tuple[int, int] = (128, 128),
                 group: int = INT4_GROUP) -> PackedExperts:
    """gate/up [I, H] and down [H, I] per expert (fp8 ones with their scale_inv grids) -> one packed layer."""
    fmt = Format.parse(fmt)
    hidden, inter = down[0].shape
    w13, w2 = [], []
    for e in range(len(gate)):
        pick = lambda lst: None if lst is None else lst[e]  # noqa: E731
        g = pack_matrix(gate[e], fmt, scale_inv=pick(gate_scale), block=block, group=group)
        u = pack_matrix(up[e], fmt, scale_inv=pick(up_scale), block=block, group=group)
        w13.append(_interleave(g, u))
        w2.append(pack_matrix(down[e], fmt, scale_inv=pick(down_scale), block=block, group=group))
    return PackedExperts(fmt, hidden, inter, w13[0].kp, w2[0].kp, _stack(w13, "data"), _stack(w2, "data"),
                         _stack(w13, "scales"), _stack(w2, "scales"), _stack(w13, "comp"), _stack(w2, "comp"),
                         _stack(w13, "flags"), _stack(w2, "flags"), block[1], group)


def _interleave(g: PackedMatrix, u: PackedMatrix) -> PackedMatrix:
    stack = lambda a, b: None if a is None else torch.stack([a, b], dim=1).flatten(0, 1)  # noqa: E731
    return PackedMatrix(g.fmt, 2 * g.n, g.k, g.kp, stack(g.data, u.data), stack(g.scales, u.scales),
                        stack(g.comp, u.comp), stack(g.flags, u.flags), g.block, g.group)


def unpack_experts(p: PackedExperts) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 weights the kernel computes with: w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I]."""
    w13, w2 = [], []
    block = (ROWS, p.block_k)  # fp8 scales are already expanded per tile
    for e in range(p.num_experts):
        def part(data, scales, comp, n, k, kp, sl):
            pick = lambda t: None if t is None else t[e][sl]  # noqa: E731
            return unpack_matrix(PackedMatrix(p.fmt, n, k, kp, data[e][sl], pick(scales), pick(comp), block=block,
                                              group=p.group))
        gate = part(p.w13_data, p.w13_scales, p.w13_comp, p.inter, p.hidden, p.kp13, slice(0, None, 2))
        up = part(p.w13_data, p.w13_scales, p.w13_comp, p.inter, p.hidden, p.kp13, slice(1, None, 2))
        w13.append(torch.cat([gate, up]))
        w2.append(part(p.w2_data, p.w2_scales, p.w2_comp, p.hidden, p.inter, p.kp2, slice(None)))
    return torch.stack(w13), torch.stack(w2)


_pools: dict[int | None, _C.MoeRunner] = {}
_spin_us = POOL_SPIN_US
_default_threads: int | None = None


# The KernelProgram being recorded (cpu_kernels/program.py), if any: kernel calls then go into it.
_recording: list = []


def runner(num_threads: int | None = None) -> _C.MoeRunner:
    """One persistent, pinned thread pool per thread count (None: set_default_threads's, else every allowed core,
    the same pool as that count), one sub-pool per NUMA node it spans. While a program records, its recorder for
    that pool."""
    start_torch_threads()
    if num_threads is None:
        num_threads = _default_threads
    pool = _pools.get(num_threads)
    if pool is None:
        cpus, nodes = pool_layout(num_threads)
        pool = _pools.get(len(cpus)) or _C.MoeRunner(cpus, nodes, _spin_us)
        _pools[num_threads] = _pools[len(cpus)] = pool
    return recordable(pool)


def recordable(target):
    """target (a MoeRunner, a SlotCall) itself, or while a program records, its recorder: the kernel calls made
    on it then go into the program."""
    return _recording[-1].recorder(target) if _recording else target


def pool_started() -> bool:
    """Whether this process has started a kernel thread pool (its cores are then fixed)."""
    return bool(_pools)


def set_default_threads(num_threads: int | None) -> None:
    """The thread count of this process's kernel calls that name none (None: every allowed core), so that an
    engine's --threads caps its norms, routers and dense layers too, on the same pool as its attention."""
    global _default_threads
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"the kernel thread pool needs at least one thread, got {num_threads}")
    _default_threads = num_threads


def set_pool_spin(spin_us: int) -> None:
    """How long idle workers of this process's pools, present and future, poll before sleeping."""
    global _spin_us
    if spin_us < 0:
        raise ValueError(f"spin must be >= 0 microseconds, got {spin_us}")
    _spin_us = spin_us
    for pool in _pools.values():
        pool.spin_us = spin_us


def fused_moe(p: PackedExperts, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              scale: float = 1.0, num_threads: int | None = None, isa: int | None = None) -> torch.Tensor:
    """out[t] = scale * sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]). x is bf16 or fp32 [T, H];
    fp32 activations are carried as hi + lo bf16 pairs, so bf16/fp8 weights see fp32-accurate inputs.
    An id of -1 drops that slot (its expert is computed elsewhere, e.g. resident on a GPU)."""
    if x.dim() != 2 or x.shape[1] != p.hidden:
        raise ValueError(f"hidden states must be [T, {p.hidden}], got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"hidden states must be bfloat16 or float32, got {x.dtype}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk ids {tuple(topk_ids.shape)} / weights {tuple(topk_weights.shape)} do not match "
                         f"{x.shape[0]} tokens")
    if x.device.type != "cpu":
        raise ValueError("the CPU MoE kernel needs CPU tensors")
    x = x.contiguous()
    ids = topk_ids.to(torch.int32).contiguous()  # the kernel checks the range
    out = torch.empty_like(x)
    if x.shape[0] == 0:
        return out
    if topk_weights.dtype == torch.bfloat16:  # widened by a kernel: a decode program records it (program.py)
        from cpu_kernels.elementwise import widen  # it imports this module

        w = widen(topk_weights, num_threads)
    else:
        w = topk_weights.to(torch.float32).contiguous()
    runner(num_threads).forward(p.layer, x.data_ptr(), x.dtype == torch.float32, x.shape[0], ids.shape[1],
                                ids.data_ptr(), w.data_ptr(), float(scale), out.data_ptr(),
                                resolve_isa(isa))
    return out


def fused_moe_reference(w13: torch.Tensor, w2: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor,
                        topk_weights: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Pure-torch fp32 reference over dequantized weights (w13 [E, 2I, H] gate then up, w2 [E, H, I])."""
    xf = x.float()
    out = torch.zeros_like(xf)
    inter = w13.shape[1] // 2
    for e in torch.unique(topk_ids[topk_ids >= 0]).tolist():
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        h = F.linear(xf[tok], w13[e].float())
        y = F.linear(F.silu(h[:, :inter]) * h[:, inter:], w2[e].float())
        out.index_add_(0, tok, y * topk_weights[tok, slot, None].float())
    return (out * scale).to(x.dtype)


def fp8_lines_to_bf16(packed_fp8: torch.Tensor, isa: int | None = None) -> torch.Tensor:
    """Runs the kernels' in-register fp8 -> bf16 conversion over packed fp8 tile bytes (for testing):
    returns the bf16 tile lines in the bf16 packed layout."""
    data = packed_fp8.contiguous().view(torch.uint8).flatten()
    if data.numel() % 64:
        raise ValueError("packed fp8 data is a whole number of 64-byte lines")
    out = torch.empty(data.numel(), dtype=torch.bfloat16)
    _C.fp8_to_bf16_lines(data.data_ptr(), data.numel() // 64, out.data_ptr(), resolve_isa(isa))
    return out
