"""trainer/common/hlo_bytes.py on a small optimized-HLO text written as libtpu prints one: tiled (padded) sizes, a fused
parameter read through a slice, an async copy counted once, a loop body times its trip count, and each
instruction's bucket from its jax stack frame (forward, backward). No compile: pure text."""
from __future__ import annotations

import pytest

from trainer.common import hlo_bytes as H

HLO = '''HloModule jit_step, is_scheduled=true

FileNames
1 "/repo/trainer/models/gpt2.py"
2 "/repo/trainer/pretrain/train.py"

FunctionNames
1 "MLP.__call__"
2 "Steps._train_step"

FileLocations
1 {file_name_id=2 function_name_id=2 line=10 end_line=10 column=1 end_column=1}
2 {file_name_id=1 function_name_id=1 line=20 end_line=20 column=1 end_column=1}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}

%fused_slice (param_0.1: f32[4096,1024]) -> f32[1024,1024] {
  %param_0.1 = f32[4096,1024]{1,0:T(8,128)} parameter(0)
  ROOT %slice.1 = f32[1024,1024]{1,0:T(8,128)} slice(%param_0.1), slice={[0:1024], [0:1024]}
}

%fused_mul (param_0.2: f32[1000,100]) -> f32[1000,100] {
  %param_0.2 = f32[1000,100]{0,1:T(8,128)} parameter(0)
  ROOT %multiply.2 = f32[1000,100]{0,1:T(8,128)} multiply(%param_0.2, %param_0.2)
}

%body (p.3: (s32[], f32[1000,100])) -> (s32[], f32[1000,100]) {
  %p.3 = (s32[]{:T(128)}, f32[1000,100]{0,1:T(8,128)}) parameter(0)
  %i.3 = s32[]{:T(128)} get-tuple-element(%p.3), index=0
  %x.3 = f32[1000,100]{0,1:T(8,128)} get-tuple-element(%p.3), index=1
  %mul_fusion = f32[1000,100]{0,1:T(8,128)} fusion(%x.3), kind=kLoop, calls=%fused_mul, metadata={op_name="jit(step)/transpose(jvp())/mul" stack_frame_id=2}
  ROOT %t.3 = (s32[]{:T(128)}, f32[1000,100]{0,1:T(8,128)}) tuple(%i.3, %mul_fusion)
}

%cond (p.4: (s32[], f32[1000,100])) -> pred[] {
  %p.4 = (s32[]{:T(128)}, f32[1000,100]{0,1:T(8,128)}) parameter(0)
  %i.4 = s32[]{:T(128)} get-tuple-element(%p.4), index=0
  %constant.4 = s32[]{:T(128)} constant(6)
  ROOT %lt.4 = pred[]{:T(512)} compare(%i.4, %constant.4), direction=LT
}

ENTRY %main (param.0: f32[4096,1024], param.1: (s32[], f32[1000,100]), param.2: bf16[8,1024]) -> f32[1024,1024] {
  %param.0 = f32[4096,1024]{1,0:T(8,128)} parameter(0)
  %param.1 = (s32[]{:T(128)}, f32[1000,100]{0,1:T(8,128)}) parameter(1)
  %param.2 = bf16[8,1024]{1,0:T(8,128)(2,1)} parameter(2)
  %copy-start = (bf16[8,1024]{1,0:T(8,128)(2,1)S(1)}, bf16[8,1024]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(%param.2)
  %copy-done = bf16[8,1024]{1,0:T(8,128)(2,1)S(1)} copy-done(%copy-start)
  %loop = (s32[]{:T(128)}, f32[1000,100]{0,1:T(8,128)}) while(%param.1), condition=%cond, body=%body
  ROOT %slice_fusion = f32[1024,1024]{1,0:T(8,128)} fusion(%param.0), kind=kLoop, calls=%fused_slice, metadata={op_name="jit(step)/jvp()/slice" stack_frame_id=1}
}
'''


def test_bytes_per_instruction_loops_and_buckets():
    m = H.parse(HLO)
    assert m.entry == "main" and set(m.computations) == {"fused_slice", "fused_mul", "body", "cond", "main"}
    # f32[1000,100] laid out {0,1} with (8,128) tiles: 100 -> 104 rows of 1000 -> 1024 lanes
    assert H.shape_bytes("f32[1000,100]{0,1:T(8,128)}") == 104 * 1024 * 4
    assert H.shape_bytes("f32[1000,100]{0,1:T(8,128)}", padded=False) == 400_000
    charges = {c.instr.name: (c.bytes, c.times) for c in H.walk(m, H.Charger(m))}
    assert charges["slice_fusion"] == (2 * 1024 * 1024 * 4, 1)  # the slice read, the result written
    assert charges["mul_fusion"] == (2 * 104 * 1024 * 4, 6)  # the body six times: its condition's bound
    assert charges["copy-start"] == (8 * 1024 * 2, 1) and "copy-done" not in charges  # counted once
    t = H.table(HLO)
    assert t["loops"] == [("body", 6)]
    compare = 4 + 4 + 1  # the condition's compare: two s32 scalars read, a pred written, each trip
    assert t["total"] == 2 * 4 * 2 ** 20 + 6 * (2 * 104 * 1024 * 4 + compare) + 8 * 1024 * 2
    assert t["once"] == 2 * 4 * 2 ** 20 + 2 * 104 * 1024 * 4 + compare + 8 * 1024 * 2
    assert t["buckets"]["MLP, backward"] == 6 * 2 * 104 * 1024 * 4  # gpt2.py MLP.__call__ under transpose(
    assert t["buckets"]["step (grad norm, accumulation)"] == 2 * 4 * 2 ** 20


KERNELS = '''HloModule jit_step, is_scheduled=true

ENTRY %main (param.0: bf16[512,128], param.1: bf16[1024,128]) -> f32[1024,128] {
  %param.0 = bf16[512,128]{1,0:T(8,128)(2,1)} parameter(0)
  %param.1 = bf16[1024,128]{1,0:T(8,128)(2,1)} parameter(1)
  %estimated = f32[1024,128]{1,0:T(8,128)} custom-call(%param.1, %param.0), custom_call_target="tpu_custom_call", backend_config={"custom_call_config":{"body":"x","cost_estimate":{"flops":"1","transcendentals":"0","bytes_accessed":"7000000","remote_bytes_transferred":"0"}}}
  ROOT %plain = f32[1024,128]{1,0:T(8,128)} custom-call(%param.1, %estimated), custom_call_target="tpu_custom_call", backend_config={"custom_call_config":{"body":"y"}}
}
'''


def test_a_kernel_with_a_cost_estimate_is_charged_its_estimate_one_without_its_operands():
    """As the TPU compiler counts a Pallas kernel that declares a cost estimate (its re-reads included); one that
    declares none (splash attention) the compiler counts as nothing: here its operands and result."""
    m = H.parse(KERNELS)
    charges = {c.instr.name: c.bytes for c in H.walk(m, H.Charger(m))}
    assert charges["estimated"] == 7_000_000
    assert charges["plain"] == 1024 * 128 * 2 + 2 * 1024 * 128 * 4


HANDED_ON = '''HloModule jit_step, is_scheduled=true

%fused_window (param_0.5: bf16[256,1024], param_1.5: bf16[2048,1024], param_2.5: bf16[256,128]) -> (f32[256,128], bf16[256,1024], bf16[2048,1024]) {
  %param_0.5 = bf16[256,1024]{1,0:T(8,128)(2,1)} parameter(0)
  %param_1.5 = bf16[2048,1024]{1,0:T(8,128)(2,1)} parameter(1)
  %param_2.5 = bf16[256,128]{1,0:T(8,128)(2,1)} parameter(2)
  %convert.5 = f32[256,128]{1,0:T(8,128)} convert(%param_2.5)
  ROOT %tuple.5 = (f32[256,128]{1,0:T(8,128)}, bf16[256,1024]{1,0:T(8,128)(2,1)}, bf16[2048,1024]{1,0:T(8,128)(2,1)}) tuple(%convert.5, %param_0.5, %param_1.5)
}

ENTRY %main (param.0: bf16[256,1024], param.1: bf16[2048,1024], param.2: bf16[256,128]) -> (f32[256,128], bf16[256,1024], bf16[2048,1024]) {
  %param.0 = bf16[256,1024]{1,0:T(8,128)(2,1)} parameter(0)
  %param.1 = bf16[2048,1024]{1,0:T(8,128)(2,1)} parameter(1)
  %param.2 = bf16[256,128]{1,0:T(8,128)(2,1)} parameter(2)
  ROOT %window = (f32[256,128]{1,0:T(8,128)}, bf16[256,1024]{1,0:T(8,128)(2,1)}, bf16[2048,1024]{1,0:T(8,128)(2,1)}) fusion(%param.0, %param.1, %param.2), kind=kLoop, calls=%fused_window
}
'''


def test_a_buffer_a_fusion_only_hands_on_costs_nothing():
    """A fusion of a windowed matmul's loop returns its carried buffers as it got them (tuple elements that are its
    parameters): they stay where they are, so only the converted window is read and written. Counting them as read
    and written each trip put 135 GB of 840 into gemma4-26b-a4b's step on v5e-8 (remat full, 4 rows of 512)."""
    m = H.parse(HANDED_ON)
    charges = {c.instr.name: c.bytes for c in H.walk(m, H.Charger(m))}
    assert charges["window"] == 256 * 128 * 2 + 256 * 128 * 4


CHAIN = '''HloModule jit_step, is_scheduled=true

%fused_start (param_0.6: bf16[1024,128]) -> (bf16[1024,128], bf16[1024,1024], u32[]) {
  %param_0.6 = bf16[1024,128]{1,0:T(8,128)(2,1)} parameter(0)
  %all-gather.6 = bf16[1024,1024]{1,0:T(8,128)(2,1)} all-gather(%param_0.6), channel_id=7, dimensions={1}, frontend_attributes={chain_id="3"}
  ROOT %custom-call.6 = (bf16[1024,128]{1,0:T(8,128)(2,1)}, bf16[1024,1024]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) custom-call(%all-gather.6), custom_call_target="AsyncCollectiveStart"
}

%fused_between (param_0.7: bf16[1024,128], param_1.7: bf16[1024,1024], param_2.7: f32[256,128]) -> (f32[256,128], bf16[1024,128], bf16[1024,1024], bf16[1024,1024]) {
  %param_0.7 = bf16[1024,128]{1,0:T(8,128)(2,1)} parameter(0)
  %param_1.7 = bf16[1024,1024]{1,0:T(8,128)(2,1)} parameter(1)
  %param_2.7 = f32[256,128]{1,0:T(8,128)} parameter(2)
  %negate.7 = f32[256,128]{1,0:T(8,128)} negate(%param_2.7)
  %all-gather.7 = bf16[1024,1024]{1,0:T(8,128)(2,1)} all-gather(%param_0.7), channel_id=7, dimensions={1}, frontend_attributes={chain_id="3"}
  ROOT %tuple.7 = (f32[256,128]{1,0:T(8,128)}, bf16[1024,128]{1,0:T(8,128)(2,1)}, bf16[1024,1024]{1,0:T(8,128)(2,1)}, bf16[1024,1024]{1,0:T(8,128)(2,1)}) tuple(%negate.7, %param_0.7, %param_1.7, %all-gather.7)
}

%fused_done (param_0.8: bf16[1024,128], param_1.8: bf16[1024,1024], param_2.8: u32[]) -> bf16[1024,1024] {
  %param_0.8 = bf16[1024,128]{1,0:T(8,128)(2,1)} parameter(0)
  %param_1.8 = bf16[1024,1024]{1,0:T(8,128)(2,1)} parameter(1)
  %param_2.8 = u32[]{:S(2)} parameter(2)
  %all-gather.8 = bf16[1024,1024]{1,0:T(8,128)(2,1)} all-gather(%param_0.8), channel_id=7, dimensions={1}, frontend_attributes={chain_id="3"}
  ROOT %custom-call.8 = bf16[1024,1024]{1,0:T(8,128)(2,1)} custom-call(%param_0.8, %param_1.8, %all-gather.8, %param_2.8), custom_call_target="AsyncCollectiveDone"
}

ENTRY %main (param.0: bf16[1024,128], param.1: f32[256,128]) -> (f32[256,128], bf16[1024,1024]) {
  %param.0 = bf16[1024,128]{1,0:T(8,128)(2,1)} parameter(0)
  %param.1 = f32[256,128]{1,0:T(8,128)} parameter(1)
  %start = (bf16[1024,128]{1,0:T(8,128)(2,1)}, bf16[1024,1024]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) fusion(%param.0), kind=kCustom, calls=%fused_start
  %gte.0 = bf16[1024,128]{1,0:T(8,128)(2,1)} get-tuple-element(%start), index=0
  %gte.1 = bf16[1024,1024]{1,0:T(8,128)(2,1)} get-tuple-element(%start), index=1
  %gte.2 = u32[]{:S(2)} get-tuple-element(%start), index=2
  %between = (f32[256,128]{1,0:T(8,128)}, bf16[1024,128]{1,0:T(8,128)(2,1)}, bf16[1024,1024]{1,0:T(8,128)(2,1)}, bf16[1024,1024]{1,0:T(8,128)(2,1)}) fusion(%gte.0, %gte.1, %param.1), kind=kOutput, output_to_operand_aliasing={{1}: (0, {}), {2}: (1, {}), {3}: (1, {})}, calls=%fused_between
  %gte.3 = f32[256,128]{1,0:T(8,128)} get-tuple-element(%between), index=0
  %gte.4 = bf16[1024,128]{1,0:T(8,128)(2,1)} get-tuple-element(%between), index=1
  %gte.5 = bf16[1024,1024]{1,0:T(8,128)(2,1)} get-tuple-element(%between), index=2
  %done = bf16[1024,1024]{1,0:T(8,128)(2,1)} fusion(%gte.4, %gte.5, %gte.2), kind=kCustom, calls=%fused_done
  ROOT %out = (f32[256,128]{1,0:T(8,128)}, bf16[1024,1024]{1,0:T(8,128)(2,1)}) tuple(%gte.3, %done)
}
'''


def test_an_async_collective_over_a_chain_of_fusions_is_charged_once():
    """libtpu splits an async collective over a chain of fusions, the same all-gather (one channel and chain id) in
    each: the start's root an AsyncCollectiveStart, the done's an AsyncCollectiveDone, the fusions between doing
    their own work and returning the in-flight buffer aliased to their operand. Charging the gathered result in
    each put 86 GB of 252 into a six-layer gemma4-26b-a4b step on v5e-8 (its tied embedding's all-gather in 12
    fusions, 10 of them inside 4-trip windowed matmul loops)."""
    m = H.parse(CHAIN)
    charges = {c.instr.name: c.bytes for c in H.walk(m, H.Charger(m))}
    assert charges["start"] == 1024 * 128 * 2 + 1024 * 1024 * 2  # the shard read, the gathered result written
    assert charges["between"] == 2 * 256 * 128 * 4  # its own negate only
    assert "done" not in charges


def test_the_bytes_tool_refuses_a_trainer_command_in_one_line(capsys):
    """`python -m bench.compiler.tpu_bytes -- <trainer command>`: a command the trainer refuses (no --ckpt-dir; a
    batch the mesh's data axis cannot split) is one `error:` line and exit 2, before anything compiles."""
    pytest.importorskip("libtpu")
    from bench.compiler import tpu_bytes
    lora = ["lora", "--model", "gemma4-26b-a4b", "--weights", "-", "--data", "-"]
    assert tpu_bytes.main(["--", *lora, "--batch-size", "8"]) == 2
    assert tpu_bytes.main(["--", *lora, "--ckpt-dir", "gs://b/r", "--batch-size", "4"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert "--ckpt-dir" in err[0] and "not divisible by the mesh's data axis (8)" in err[1], err
