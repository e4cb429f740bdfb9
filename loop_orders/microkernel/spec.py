"""What a forward micro-kernel build is, apart from any one build's code.

`Layout` names the CUDA-core build (a thread tile of S_ij, `microkernel`); `TensorCores`
(`tensor_cores`) and `Specialised` (`warp_specialised`) name the others. Every build returns
the device functions of `MicroKernel`, so a loop nest runs on any of them unchanged. This
module depends on no build, so each build's module can import it.
"""

from __future__ import annotations

from functools import cache
from typing import NamedTuple

from .tiles import odd_stride

DATA_REGISTERS = 64  # scores + accumulators per thread that fit beside the rest under 128


class Layout(NamedTuple):
    """How a CTA's threads tile S_ij: RM query rows and KN keys per thread.

    A CTA has TR = ceil(Br / RM) by TC = ceil(Bc / KN) threads. Where RM or KN does not
    divide the tile, the last threads also own rows past Br (computed on zeros, never
    written) or keys past Bc (masked like keys past N_k). With `stages` 2 a loop nest that
    streams K/V (q_outer) staggers their loads: V_j lands while S_ij is computed and K_j+1
    while P_ij V_j is, in the one K and one V buffer (`MicroKernel.STAGGERED`). With `p_in_k`
    P_ij^T takes K_j's place once S_ij is done (a barrier between), so the buffer has no
    region of its own for it: small enough at 64 x 64 tiles and d = 128 that two CTAs fit an
    SM; K_j and V_j then arrive together, by cp.async where the rows allow, not staggered."""

    rm: int
    kn: int
    stages: int = 1
    p_in_k: bool = False
    # the arrays (of "qkvo") moved 16 bytes at a time where `copies_rows`: 16-byte aligned
    ALIGNED = "kv"
    # Inputs cp.async cannot copy (not 16-byte aligned) take the same thread tile with plain
    # loads (`plain`) rather than being refused.
    falls_back = True

    def buffer_bytes(self, block_q: int, block_k: int, d: int, dv: int, reload: bool,
                     transpose_q: bool) -> int:
        """Bytes of a CTA's dynamic shared buffer (`shared_layout`)."""
        return shared_layout(block_q, block_k, d, dv, self, reload, transpose_q).bytes

    def work_grid(self, grid: tuple, args: tuple, p=None) -> tuple[tuple, tuple]:
        """The launch's grid and kernel arguments: a CTA per work item, as given."""
        return grid, args

    @property
    def groups(self) -> int:
        """G: a thread's rows come in groups of G consecutive tile rows (4 where 4 divides
        RM, else 2, else 1), the groups G TR rows apart (`row_of`)."""
        return 4 if self.rm % 4 == 0 else (2 if self.rm % 2 == 0 else 1)

    def copies_rows(self, d: int, dv: int) -> bool:
        """Whether K and V rows arrive by cp.async (staggered, whole 16-byte rows: the
        source must then be 16-byte aligned), else by plain loads."""
        return (self.stages > 1 or self.p_in_k) and d % 4 == 0 and dv % 4 == 0

    @property
    def staggered(self) -> bool:
        """Whether K_j's and V_j's loads are staggered (`stages` 2, P_ij^T a region of its
        own)."""
        return self.stages > 1 and not self.p_in_k

    def plain(self) -> Layout:
        """This thread tile with plain K/V loads (no cp.async, hence no alignment needed)."""
        return self._replace(stages=1, p_in_k=False)

    def grid(self, block_q: int, block_k: int) -> tuple[int, int]:
        """(TR, TC)."""
        return -(-block_q // self.rm), -(-block_k // self.kn)

    def threads(self, block_q: int, block_k: int) -> int:
        tr, tc = self.grid(block_q, block_k)
        return tr * tc

    def accumulators(self, block_k: int, dv: int) -> int:
        """A thread's accumulators of O_i: RM rows x 4 XH dims (whole 4-wide chunks, so the
        last chunk may run past dv)."""
        tc = self.grid(1, block_k)[1]
        return self.rm * 4 * -(-dv // (4 * tc))

    def data_registers(self, block_k: int, dv: int) -> int:
        """Registers a thread's scores and accumulators take (RM KN + RM 4 XH)."""
        return self.rm * self.kn + self.accumulators(block_k, dv)

    def registers(self, block_k: int, dv: int, reload: bool = False) -> int:
        """The register cap to compile with: 128 (two CTAs of 256 threads per SM) unless
        the thread's scores and accumulators alone take more than 64 registers (whether the
        loop nest reloads O_i, `reload`, does not change that here)."""
        return 255 if self.data_registers(block_k, dv) > DATA_REGISTERS else 128


class MicroKernel(NamedTuple):
    """The device functions of one micro-kernel build, over one CTA's shared buffer `buf`
    (see the module docstring). Those with barriers (online_update, row_sums) are called by
    every thread of the CTA.

    clear(buf)                        zero the buffer (once per CTA, before any tile lands)
    online_update(buf, n_keys, key0, diag0, m, l, acc, scale_log2, stage)
                                      fold K_j, V_j (keys key0 .. key0 + n_keys) into the
                                      thread's rows, each over the keys it sees
                                      (`core.mask`; diag0 = row0 + N_k - N_q, the block's
                                      first row's diagonal key); here Q_i is in shared memory
                                      pre-scaled by scale log2(e) (load_q), so scale_log2
                                      goes unused (the tensor-core one scales S);
                                      `stage` too (one K/V buffer here)
    row_sums(buf, l, l_row)           l_row[a] = the full l_i of row a (from the partials)
    give_o(buf, acc, factor)          O_i = acc * factor[a] into its stage (kv_outer's O_i
                                      stage, else the Q_i tile, which is done with by then):
                                      normalised when factor = 1 / l_row, as the caller
                                      chooses (`reciprocal`)
    reciprocal(x, out)                out[a] = 1 / x[a] for the thread's rows (under a
                                      mask 0 where x[a] = 0: a row that saw no key)
    take_o(buf, acc, l, l_row, m)     kv_outer: acc = O_i l_i from the O_i stage, m and l
                                      from the stats rows (l as part tc = 0's partial)
    keep_stats(buf, l_row, m)         kv_outer: l_i, m_i of the thread's rows to the stats
    coords()                          this thread's place in the layout
    row_of(tr, a)                     the tile row of the thread's row a (uint64; CUDA
                                      cores only)
    load_q(buf, q, bh, row0, n_rows, scale_log2), load_k(buf, k, bh, key0, n_keys, stage),
    load_v(buf, v, bh, key0, n_keys, stage)
                                      HBM -> the tile (rows past n_rows as the micro-kernel
                                      needs them); each returns the elements this thread
                                      counted; every thread calls them, then wait_loads(),
                                      then the caller's barrier
    wait_loads()                      this thread's loads have landed (tensor cores copy
                                      asynchronously; a no-op on CUDA cores)
    load_o(buf, o, bh, row0, n_rows), store_o(buf, o, bh, row0, n_rows)
                                      O_i between HBM and its stage (kv_outer loads it)
    store_lse(lse, bh, row0, n_rows, m, l_row)
                                      lse_i of the thread's rows that hold it; returns how
                                      many it wrote
    NT, RM, NACC                      threads per CTA; rows and accumulators per thread
    ROWS, STATS                       rows of the tiles; float offset of kv_outer's l_i, m_i
                                      rows (m_i ROWS after l_i)
    STAGES                            K/V buffers: with 2, the loop nest loads K_j+1, V_j+1
                                      (`stage` (j + 1) % 2) while it folds in K_j, V_j
    STAGGERED                         (CUDA cores, one K/V buffer) online_update is also
                                      given in halves, so that a loop nest can load V_j
                                      under the first and K_j+1 under the second:
    weigh(buf, n_keys, key0, diag0, m, l, acc, vis)
                                      S_ij, the row statistics and P_ij into shared memory
                                      (vis: a local int32 array of 2 RM, the span of keys
                                      row a sees: [vis[RM + a], vis[a]));
                                      then the caller's barrier, then
    fold(buf, acc, vis)               acc += P_ij V_j
    PIPELINED                         (Hopper's tensor cores, a ring of K/V buffers)
                                      online_update is also given with P_ij V_j a tile
                                      behind, so that the product runs under the next
                                      tile's softmax:
    weigh_ahead(buf, n_keys, key0, diag0, m, l, acc, p, scale_log2, k_stage, v_stage)
                                      on the warpgroup's turn, S_ij (K_j in buffer
                                      k_stage), with P_i,j-1 V_j-1 (p: the previous call's
                                      weights, a local float32 array of NS; V_j-1 in buffer
                                      v_stage) behind it; each buffer released once its
                                      product has landed; leaves P_ij in p; for the block's
                                      first tile, weigh_first (the same arguments, no
                                      product behind); after the last tile, once V_j has
                                      landed (the ring's wait),
    fold_last(buf, acc, p, v_stage)   acc += P_ij V_j
    ring                              the K/V buffers' mbarriers and the warpgroups' turns
                                      (`hopper.StageRing`): K_j in buffer t % K_BUFFERS,
                                      V_j in t % V_BUFFERS (t = j - j0)
    NS                                a thread's scores (p's size)
    producer(COUNT)                   where a producer warpgroup fills the ring by TMA
                                      (else None): its copies, `hopper.make_tma_producer`
                                      (COUNT: counted); the loop nest's kernel runs it
                                      beside NT computing threads
    """

    clear: object
    online_update: object
    row_sums: object
    give_o: object
    reciprocal: object
    take_o: object
    keep_stats: object
    coords: object
    load_q: object
    load_k: object
    load_v: object
    wait_loads: object
    load_o: object
    store_o: object
    store_lse: object
    NT: int
    RM: int
    NACC: int
    ROWS: int
    STATS: int
    STAGES: int
    STAGGERED: bool = False
    weigh: object = None
    fold: object = None
    row_of: object = None
    PIPELINED: bool = False
    weigh_first: object = None
    weigh_ahead: object = None
    fold_last: object = None
    ring: object = None
    NS: int = 0
    producer: object = None


def _round4(n: int) -> int:
    return -(-n // 4) * 4


class SharedLayout(NamedTuple):
    """Offsets (floats) and row strides of the tiles in a CTA's dynamic shared buffer."""

    q: int  # Q_i, Br rows (q_outer also writes O_i through it, once Q_i is done with)
    qs: int
    qts: int  # Q_i^T's row stride (a row per head dim)
    q_transposed: bool  # Q_i is kept as Q_i^T (TRANSPOSE_Q, rows in groups of 4), else Q_i
    k: int  # K_j, Bc rows
    ks: int
    v: int  # V_j, Bc rows
    vs: int
    p: int  # P_ij^T, a row per key a thread owns (Bc or a few more), a column per query row
    ps: int
    red: int  # per-thread row partials (max, then sums), RM per thread
    o: int  # kv_outer: the stage of O_i in and out (Br rows, stride qs), in P_ij^T's place
    stats: int  # kv_outer only: l_i then m_i of the block's rows
    size: int  # floats in all

    @property
    def bytes(self) -> int:
        return 4 * self.size


@cache
def shared_layout(BR: int, BC: int, D: int, DV: int, lay: Layout,
                  reload: bool, transpose_q: bool = False) -> SharedLayout:
    """The buffer for one CTA; `reload` adds kv_outer's O_i stage and l_i, m_i rows, and
    `transpose_q` keeps Q_i transposed where the layout's rows come in groups of 4. Tiles
    have a row for every row (key) a thread owns, past Br (Bc) too. kv_outer's O_i stage
    shares P_ij^T's space: O_i is taken before P_ij^T is written (the caller puts a barrier
    between: what a thread writes of P_ij^T is other threads' rows of the O_i stage) and given
    after P V_j."""
    tr, tc = lay.grid(BR, BC)
    rows, keys = tr * lay.rm, tc * lay.kn
    qs = odd_stride(max(D, DV))  # Q_i or O_i, a row per query row
    qts = odd_stride(rows)  # Q_i^T: a row per head dim, a column per query row
    ks = odd_stride(D)
    vs = -(-DV // (4 * tc)) * 4 * tc  # whole 4-wide chunks for every thread of a row
    ps = odd_stride(rows)  # P_ij^T: a row of the thread's query rows per key
    q_transposed = transpose_q and lay.groups == 4
    if lay.p_in_k and reload:
        raise ValueError("P_ij^T in K_j's place leaves no room for the O_i stage (reload)")
    # Q_i's region holds Q_i or Q_i^T, and O_i on its way out; K_j's, with p_in_k, P_ij^T
    # once S_ij is done
    p_size = max(keys * ps, rows * qs if reload else 0)
    sizes = [max(rows * qs, _round4(D) * qts if q_transposed else 0),
             max(keys * ks, p_size if lay.p_in_k else 0), BC * vs,
             0 if lay.p_in_k else p_size, tr * tc * lay.rm, 2 * rows if reload else 0]
    q, k, v, p, red, stats, size = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    p = k if lay.p_in_k else p
    return SharedLayout(q, qs, qts, q_transposed, k, ks, v, vs, p, ps, red,
                        p if reload else 0, stats, size)
