"""The SASS reader of experiments.sass_loops, on a hand-written listing in nvdisasm's form
(no toolkit needed): loops from backward branches, nesting, opcodes without predicates or
modifiers, copy blocks."""

from experiments.sass_loops import copy_blocks, loops, parse

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


def test_copy_blocks_count_instructions_per_cp_async():
    _, _, blocks = parse(LISTING)
    assert copy_blocks(blocks) == [{"label": ".L_x_1", "start": "0x20", "instructions": 8,
                                    "copies": 2, "per_copy": 4.0}]
