"""trainer/common/hlo_bytes.py on a small optimized-HLO text written as libtpu prints one: tiled (padded) sizes, a fused
parameter read through a slice, an async copy counted once, a loop body times its trip count, and each
instruction's bucket from its jax stack frame (forward, backward). No compile: pure text."""
from __future__ import annotations

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
