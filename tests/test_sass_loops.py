"""The SASS reader of experiments.sass_loops, on a hand-written listing in nvdisasm's form
(no toolkit needed): loops from backward branches, nesting, opcodes without predicates or
modifiers, copy blocks."""

from experiments.sass_loops import bank_conflicts, copy_blocks, loops, parse

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDS.128 R4, [R2] ;
.L_x_1:
        /*0020*/                   FFMA R8, R4, R5, R8 ;
        /*0030*/              @!P0 FFMA R9, R4, R6, R9 ;
        /*0040*/               @P1 BRA `(.L_x_1) ;
        /*0050*/                   LDGSTS.E.BYPASS.128 [R10], desc[UR4][R12.64] ;
        /*0060*/                   LDGSTS.E.BYPASS.128 [R10+0x100], desc[UR4][R12.64+0x200] ;
        /*0070*/                   ISETP.GE.U32.AND P2, PT, R3, 0x40, PT ;
        /*0080*/               @P2 BRA `(.L_x_0) ;
        /*0090*/                   BRA `(.L_x_2) ;
.L_x_2:
        /*00a0*/                   EXIT ;
"""


def test_parse_finds_loops_nesting_and_opcodes():
    instructions, labels, blocks = parse(LISTING)
    assert len(instructions) == 11
    assert labels == {".L_x_0": 0x10, ".L_x_1": 0x20, ".L_x_2": 0xA0}
    assert [i.opcode for i in instructions[2:5]] == ["FFMA", "FFMA", "BRA"]
    found = {(lp.start, lp.end): lp for lp in loops(instructions, labels)}
    assert set(found) == {(0x20, 0x40), (0x10, 0x80)}  # the forward BRA is no loop
    inner, outer = found[0x20, 0x40], found[0x10, 0x80]
    assert (inner.instructions, inner.ffma, inner.shared_loads, inner.nested) == (3, 2, 0, 0)
    assert (outer.instructions, outer.ffma, outer.shared_loads, outer.nested) == (8, 2, 1, 1)
    # FFMA R8, R4, R5, R8: R4 and R8 share bank 0 (one cycle); then R4, R6 and R9 (one)
    assert inner.bank_conflicts == outer.bank_conflicts == 2


def test_copy_blocks_count_instructions_per_cp_async():
    _, _, blocks = parse(LISTING)
    assert copy_blocks(blocks) == [{"label": ".L_x_1", "start": "0x20", "instructions": 8,
                                    "copies": 2, "per_copy": 4.0}]


def test_bank_conflicts_count_sources_sharing_a_bank_past_the_reuse_cache():
    """Sources in the same of two banks (register mod 2) beyond the first cost a cycle each,
    unless the operand reuse cache holds them (the same register in the same slot, marked
    .reuse by the FFMA before); any other instruction empties the cache."""
    listing = """
        /*0000*/                   FFMA R10, R2, R4, R6 ;
        /*0010*/                   FFMA R11, R3, R5.reuse, R7 ;
        /*0020*/                   FFMA R12, R2, R5, R7 ;
        /*0030*/                   FFMA R13, R3, R5.reuse, R9 ;
        /*0040*/                   MOV R1, R0 ;
        /*0050*/                   FFMA R14, -R3, R5, |R1| ;
        /*0060*/                   FFMA R15, R2, 0x3f800000, R3 ;
"""
    instructions, _, _ = parse(listing)
    # alone: three even sources, three odd, one even and two odd, three odd, (MOV), three odd
    # (negated or absolute values read their registers too), an immediate beside one of each
    assert [bank_conflicts([ins]) for ins in instructions] == [2, 2, 1, 2, 0, 2, 0]
    # in a row, the third finds R5 in slot 1's cache (R2 and R7 apart: 0); the fourth does
    # not (the third did not mark it .reuse), and the MOV empties the cache before the sixth
    assert bank_conflicts(instructions) == 2 + 2 + 0 + 2 + 2


def test_tensor_core_loops_count_mma_ldmatrix_stores_barriers_and_atomics():
    """A loop of HMMA is reported by its tensor-core instructions even without an FFMA."""
    listing = """
.L_x_0:
        /*0000*/                   LDSM.16.M88.4 R4, [R2] ;
        /*0010*/                   HMMA.16816.F32 R8, R4, R6, R8 ;
        /*0020*/                   HMMA.16816.F32 R12, R4, R7, R12 ;
        /*0030*/                   STS [R3], R8 ;
        /*0040*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0050*/                   REDG.E.ADD.F32.FTZ.RN.STRONG.GPU desc[UR4][R14.64], R9 ;
        /*0060*/               @P0 BRA `(.L_x_0) ;
"""
    instructions, labels, _ = parse(listing)
    (loop,) = loops(instructions, labels)
    assert (loop.instructions, loop.hmma, loop.ldsm, loop.shared_stores, loop.barriers,
            loop.atomics, loop.ffma) == (7, 2, 1, 1, 1, 1, 0)
