"""bench/kernel_mix.py's PTX parsing (the dump itself needs a GPU): statements inside inline asm
count, several to a line; directives do not; labels inside each asm block are its own; the
largest loop is the span of the longest backward branch."""

from __future__ import annotations

from bench.kernel_mix import largest_loop, mix, parse

WAIT = """	// begin inline asm
	{
	.reg .pred       P1;
	LAB_WAIT:
	mbarrier.try_wait.parity.shared.b64 P1, [%r2], %r3, %r4;
	@P1 bra.uni DONE;
	bra.uni     LAB_WAIT;
	DONE:
	}
	// end inline asm
"""  # Mosaic's barrier wait: the same labels in every copy

PTX = """
.visible .entry k(
.reg .b32 %r<9>;
{
	mov.u32 	%r1, 0;
	bra.uni 	$L__BB0_1;
$L__BB0_1:
	.loc	1 0 4
{WAIT}	ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r5, %r6, %r7, %r8}, [%rd1];
	cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r1], [%rd2, {%r3, %r4}], [%r2];
	// begin inline asm
	{ .reg .b32 t, c; lop3.b32 t, %r5, 0x000f000f, 0x43004300, 0xEA; mov.b32 c, 0x43084308; sub.bf16x2 %r6, t, c; }

	// end inline asm
	// begin inline asm
	{ .reg .pred p; setp.ne.b32 p, 1, 0; wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%r1,%r2,%r3,%r4}, {%r5,%r6,%r7,%r8}, %rd28, p, 1, 1, 0; }
	// end inline asm
{WAIT}	@%p1 bra 	$L__BB0_1;
	ret;
}
""".replace("{WAIT}", WAIT)


def test_inline_asm_statements_count_and_their_labels_stay_in_their_block():
    instructions, labels, branches = parse(PTX)
    ops = mix(instructions)
    assert ops["lop3.b32"] == ops["sub.bf16x2"] == ops["setp.ne.b32"] == 1
    assert ops["wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16"] == 1
    assert ops["mbarrier.try_wait.parity.shared.b64"] == 2 and ops["ldmatrix.sync.aligned.m8n8.x4.shared.b16"] == 1
    assert not any(op.startswith((".", "@", "{", "%")) for op in ops)  # no directive, predicate or operand
    assert "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes" in ops
    # each asm block's LAB_WAIT / DONE resolve inside that block
    for at, target in branches:
        if target.endswith("LAB_WAIT"):
            assert 0 <= at - labels[target] <= 2
    loop = largest_loop(instructions, labels, branches)
    assert loop[-1] == "bra" and loop[0] == "mbarrier.try_wait.parity.shared.b64"
    assert mix(loop)["mbarrier.try_wait.parity.shared.b64"] == 2 and "ret" not in loop and "mov.u32" not in loop
