"""Decisions the CUDA path makes, tested on the CPU as pure functions of what a GPU or a
library reports: precision by compute capability, where CUDA graphs replay,
the kernel search and CUDA graphs as inductor options, datasheet peaks by device name, which errors are out of memory and which mean a lost peer,
the channel-statistics chunk size, and the DDP arguments of the installed torch."""
from __future__ import annotations

import pytest
import torch

from speedrun import compat
from speedrun.data.pipeline.resident import STATS_BYTES, channel_stats, stats_chunk
from speedrun.engine.batch_finder import is_out_of_memory
from speedrun.engine.flops import known_peak
from speedrun.engine.compiling import choice_costs, inductor_options
from speedrun.engine.runtime import Runtime, auto_cuda_precision, resolve_runtime, uses_cuda_graphs
from speedrun.errors import RecipeError
from speedrun.recipe import RuntimeConfig
from speedrun.engine.distributed import lost_peer


@pytest.mark.parametrize("capability, precision", [
    ((7, 0), "fp16"),     # V100: fp16 tensor cores only (bf16 would be emulated)
    ((7, 5), "fp16"),     # T4
    ((8, 0), "bf16"),     # A100
    ((8, 6), "bf16"),     # A10, RTX 3090
    ((8, 9), "bf16"),     # L4, L40S, RTX 4090
    ((9, 0), "bf16"),     # H100, H200
    ((10, 0), "bf16"),    # B200
    ((12, 0), "bf16"),    # RTX 5090
])
def test_auto_precision_follows_compute_capability(capability, precision):
    assert auto_cuda_precision(capability) == precision


@pytest.mark.parametrize("model, said", [("timm", "not timm's networks"), ("custom", "not your networks"),
                                         ("speednet", None), ("resnet", None)])
def test_auto_compiles_any_network_on_cuda_and_says_which_it_has_not_timed(model, said):
    """On CUDA "auto" compiles every network; for one speedrun has not timed compiled there (a timm
    network, your own) the start line says so and how to run it eager. (A CUDA device is only named
    here: with the precision given, the decision asks the device nothing.)"""
    cfg = RuntimeConfig(precision="bf16")
    rt = resolve_runtime(cfg, torch.device("cuda"), model, 1000)
    assert rt.compile
    lines = [c for c in rt.choices if c.startswith("compile on: CUDA compiles every network")]
    if said is None:
        assert not lines
    else:
        assert len(lines) == 1 and said in lines[0] and "runtime.compile=off runs eager" in lines[0]
    off = resolve_runtime(RuntimeConfig(precision="bf16", compile="off"), torch.device("cuda"), model, 1000)
    assert not off.compile and not any(c.startswith("compile on") for c in off.choices)


TORCH_MODES = {("default", False): "default", ("default", True): "reduce-overhead",
               ("max-autotune", True): "max-autotune", ("max-autotune", False): "max-autotune-no-cudagraphs"}
"""Each pair of the two choices and the torch.compile mode that means the same."""


@pytest.mark.parametrize("choice, torch_mode", TORCH_MODES.items())
def test_the_two_choices_give_inductor_what_its_modes_would(choice, torch_mode):
    """Kernel search and CUDA graphs, chosen apart, are exactly torch's own table of mode
    options for the mode that combines them (so a change of meaning in torch fails here)."""
    from torch._inductor import list_mode_options
    assert (inductor_options(*choice) or {}) == list_mode_options(torch_mode)


@pytest.mark.parametrize("mode, graphs, replayed", [
    ("default", "auto", False), ("default", "on", True), ("default", "off", False),
    ("max-autotune", "auto", True), ("max-autotune", "on", True), ("max-autotune", "off", False)])
def test_cuda_graphs_are_replayed_where_asked_on_cuda_compiled_by_inductor(mode, graphs, replayed):
    assert uses_cuda_graphs("cuda", True, mode, "inductor", graphs) == replayed
    assert not uses_cuda_graphs("cuda", True, mode, "aot_eager", graphs)     # other backends take no options
    assert not uses_cuda_graphs("cpu", True, mode, "inductor", graphs)
    assert not uses_cuda_graphs("cuda", False, mode, "inductor", graphs)
    assert Runtime(torch.device("cuda"), "bf16", True, True, mode, graphs=graphs).cuda_graphs == replayed


@pytest.mark.parametrize("old, mode, graphs", [("reduce-overhead", "default", "on"),
                                               ("max-autotune-no-cudagraphs", "max-autotune", "off")])
def test_the_one_field_spellings_read_as_the_two_fields(old, mode, graphs):
    cfg = RuntimeConfig.model_validate({"compile_mode": old})
    assert (cfg.compile_mode, cfg.cuda_graphs) == (mode, graphs)
    assert RuntimeConfig.model_validate({"compile_mode": old, "cuda_graphs": graphs}).cuda_graphs == graphs
    with pytest.raises(ValueError, match="set the two fields"):
        RuntimeConfig.model_validate({"compile_mode": old, "cuda_graphs": "off" if graphs == "on" else "on"})


def test_each_choice_says_its_compile_seconds_on_cuda_and_nothing_on_a_cpu():
    default = choice_costs("cuda", "default", False)
    tuned = choice_costs("cuda", "max-autotune", True)
    assert len(default) == len(tuned) == 2
    assert "27 s" in default[0] and "measured" in default[0] and "off" in default[1]
    assert "141 s" in tuned[0] and "estimate" in tuned[0] and "24 s" in tuned[1]
    assert choice_costs("cpu", "default", False) == []
    h100 = resolve_runtime(RuntimeConfig(precision="bf16", compile_mode="max-autotune"), torch.device("cuda"))
    assert h100.compile and h100.cuda_graphs and all(line in h100.choices for line in tuned)


def test_a_kernel_search_is_refused_where_a_cpu_would_compile_it():
    cfg = RuntimeConfig(compile="on", compile_mode="max-autotune", precision="fp32")
    with pytest.raises(RecipeError, match="runtime.compile_mode=default"):
        resolve_runtime(cfg, torch.device("cpu"))
    # not compiled, nothing to refuse; CUDA graphs asked for on a CPU are said to be none
    eager = resolve_runtime(cfg.model_copy(update={"compile": "off"}), torch.device("cpu"))
    assert not eager.compile
    graphs = resolve_runtime(RuntimeConfig(compile="off", cuda_graphs="on", precision="fp32"), torch.device("cpu"))
    assert not graphs.cuda_graphs and any("none on a CPU" in line for line in graphs.choices)


@pytest.mark.parametrize("name, bf16, fp16", [
    ("NVIDIA H100 80GB HBM3", 989.4e12, 989.4e12),
    ("NVIDIA H100 PCIe", 756.0e12, 756.0e12),
    ("NVIDIA H100 NVL", 835.5e12, 835.5e12),
    ("NVIDIA H200", 989.4e12, 989.4e12),
    ("NVIDIA A100-SXM4-80GB", 312.0e12, 312.0e12),
    ("NVIDIA A100 80GB PCIe", 312.0e12, 312.0e12),
    ("NVIDIA RTX A1000", None, None),                 # not an A100
    ("NVIDIA L4", 121.0e12, 121.0e12),
    ("NVIDIA L40S", 362.0e12, 362.0e12),              # not an L4
    ("NVIDIA L40", 181.0e12, 181.0e12),
    ("Tesla V100-SXM2-16GB", None, 125.0e12),
    ("Tesla V100-PCIE-32GB", None, 112.0e12),
    ("Tesla T4", None, 65.0e12),
    ("NVIDIA GeForce RTX 4090", 165.2e12, 165.2e12),
    ("NVIDIA A10G", None, None),                      # unknown: no peak rather than a wrong one
    ("NVIDIA A10", 125.0e12, 125.0e12),               # not an A100, nor the A10G
    ("NVIDIA A40", 149.7e12, 149.7e12),
    ("Tesla V100S-PCIE-32GB", None, 130.0e12),        # not a V100
    ("NVIDIA GH200 480GB", 989.4e12, 989.4e12),       # not an H200
])
def test_datasheet_peaks_match_whole_model_names(name, bf16, fp16):
    assert known_peak(name, "bf16") == bf16 and known_peak(name, "fp16") == fp16


@pytest.mark.parametrize("text, oom", [
    ("CUDA out of memory. Tried to allocate 2.00 GiB", True),
    ("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported", True),
    ("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", True),
    ("cuDNN error: CUDNN_STATUS_ALLOC_FAILED", True),
    ("[enforce fail at alloc_cpu.cpp:117] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
     "allocate 1099511627776 bytes. Error code 12 (Cannot allocate memory)", True),
    ("could not create a primitive", True),                       # oneDNN's scratch memory on a CPU
    ("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input.",
     False),
    ("CUDA error: an illegal memory access was encountered", False),
    ("mat1 and mat2 shapes cannot be multiplied (4x5 and 6x7)", False),
])
def test_out_of_memory_is_recognised_in_every_library_s_words(text, oom):
    assert is_out_of_memory(RuntimeError(text)) is oom
    assert is_out_of_memory(torch.OutOfMemoryError("anything"))


@pytest.mark.parametrize("err, lost", [
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                  "[10.0.0.2]:40123"), True),
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 10000ms for "
                  "recv operation to complete"), True),
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection reset by peer"), True),
    (RuntimeError("NCCL communicator was aborted on rank 1."), True),
    (RuntimeError("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE) "
                  "ran for 600000 milliseconds before timing out."), True),
    (RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error (run with NCCL_DEBUG=INFO for "
                  "details), NCCL version 2.21.5"), False),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), False),
    (RuntimeError("CUDA error: device-side assert triggered"), False),
    (RuntimeError("Expected all tensors to be on the same device"), False),
])
def test_a_local_cuda_error_is_not_blamed_on_other_ranks(err, lost):
    assert lost_peer(err) is lost


def test_distributed_network_errors_are_lost_peers():
    assert lost_peer(torch.distributed.DistNetworkError("recv failed"))


def test_channel_statistics_chunks_shrink_for_large_images_and_keep_the_result():
    assert stats_chunk((3, 32, 32)) == STATS_BYTES // (8 * 3 * 32 * 32) == 2730
    assert stats_chunk((3, 224, 224)) == 55 and stats_chunk((3, 8192, 8192)) == 1
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (300, 3, 224, 224), generator=gen, dtype=torch.uint8)   # six chunks
    mean, std = channel_stats(images)
    x = images.double()
    assert torch.allclose(mean.double(), x.mean(dim=(0, 2, 3)), rtol=1e-6)
    assert torch.allclose(std.double(), x.transpose(0, 1).reshape(3, -1).std(dim=1), rtol=1e-5)


def test_ddp_arguments_follow_what_the_installed_release_accepts():
    def new_ddp(self, module, device_ids=None, bucket_cap_mb=None, init_sync=True, forward_sync_buffers=None,
                gradient_as_bucket_view=False): ...

    def old_ddp(self, module, device_ids=None, broadcast_buffers=True, bucket_cap_mb=25,
                gradient_as_bucket_view=False): ...
    assert compat.ddp_options_for(new_ddp) == {"gradient_as_bucket_view": True, "forward_sync_buffers": False,
                                               "init_sync": False}
    assert compat.ddp_options_for(old_ddp) == {"gradient_as_bucket_view": True, "broadcast_buffers": False}
    # the installed torch takes every argument chosen for it
    real = torch.nn.parallel.DistributedDataParallel.__init__
    assert all(compat.accepts(real, k) for k in compat.ddp_options())


def test_dynamo_limits_are_set_under_either_name():
    class New:
        recompile_limit, fail_on_recompile_limit_hit = 8, False

    class Old:
        cache_size_limit = 8
    new, old = New(), Old()
    compat.set_recompile_limit(new, 64)
    compat.set_recompile_limit(old, 64)
    assert (new.recompile_limit, new.fail_on_recompile_limit_hit) == (64, True) and old.cache_size_limit == 64


def test_inductor_loop_reordering_is_turned_off_only_where_fused_nodes_assert():
    from torch._inductor import config as inductor_config
    from torch._inductor.scheduler import FusedSchedulerNode

    class Asserting:                     # the shape of torch 2.11's method: asserts on a fused child
        snodes = ()

        def reorder_loops_by_dep_pair(self, self_dep, other_dep):
            for snode in self.snodes:
                assert isinstance(snode, SchedulerNode)  # noqa: F821
            return False

    class Declining:                     # the shape of torch 2.13's: declines first, asserts later
        snodes = ()

        def reorder_loops_by_dep_pair(self, self_dep, other_dep):
            for snode in self.snodes:
                if not isinstance(snode, SchedulerNode):  # noqa: F821
                    return False
            for snode in self.snodes:
                assert isinstance(snode, SchedulerNode)  # noqa: F821
            return True

    class Config:
        loop_ordering_after_fusion = True
    assert compat.fused_reorder_asserts(Asserting) and not compat.fused_reorder_asserts(Declining)
    assert not compat.fused_reorder_asserts(object)
    on, off = Config(), Config()
    assert compat.avoid_fused_reorder_assert(off, Asserting) and off.loop_ordering_after_fusion is False
    assert compat.avoid_fused_reorder_assert(on, Declining) is None and on.loop_ordering_after_fusion is True
    # the tested releases decline, so a compiled run there keeps inductor's setting untouched
    before = inductor_config.loop_ordering_after_fusion
    assert not compat.fused_reorder_asserts(FusedSchedulerNode)
    assert compat.avoid_fused_reorder_assert(inductor_config, FusedSchedulerNode) is None
    assert inductor_config.loop_ordering_after_fusion == before


SYNC_BN = """
import os, sys, torch, torch.distributed as dist
import torch._dynamo as dynamo
from speedrun.models.norm import BatchNorm
from speedrun.recipe import NormConfig
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
torch.manual_seed(0)
bn = BatchNorm(4, NormConfig(sync_ranks=0))
bn.group = dist.group.WORLD
x = torch.randn(8, 4, 5, 5, requires_grad=True)
def loss(x):
    return (bn(x) * torch.arange(4.0)[:, None, None]).square().sum()
explained = dynamo.explain(loss)(x)
eager = loss(x); eager.backward(); g_eager = x.grad.clone(); x.grad = None
compiled = torch.compile(loss, backend="aot_eager")(x); compiled.backward()
print(explained.graph_count, explained.graph_break_count, torch.allclose(eager, compiled),
      torch.allclose(g_eager, x.grad, atol=1e-6))
dist.destroy_process_group()
"""


def test_synchronised_batch_norm_compiles_into_one_graph_with_its_all_reduce():
    """One gloo process is a real process group: the compiled model keeps its all-reduce in
    the graph (no break, no silent eager) and computes what eager computes, gradients too."""
    import socket
    import subprocess
    import sys
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-c", SYNC_BN, str(port)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["1", "0", "True", "True"], proc.stdout + proc.stderr[-2000:]
