"""KDA slot access in the arena: the dense gather/scatter path and the in-place row update agree,
and the in-place update writes exactly one layer's units of each row's working slot."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3jax
from pallas_kernels.kda.reference import kda_token_step
from serve.latent_codec import pack_words
from serve.memory import (ArenaLayout, gather_states, read_conv, read_layer_states, scatter_states,
                          update_states_in_place, write_layer_states)


@pytest.fixture(scope="module", params=[("tiny-k3", 16, "float32"), ("tiny-kimi-linear", 64, "float32"),
                                        ("tiny-k3", 16, "bfloat16")], ids=lambda p: f"{p[0]}-p{p[1]}-{p[2]}")
def layout(request):
    name, page, state_dtype = request.param
    cfg = k3jax.load_model(name, seed=0).cfg
    return ArenaLayout.plan(cfg, 400 * page * 40 * 4, page, jnp.float32, kda_state_dtype=state_dtype)


def random_arena(layout, seed):
    """Random words; with bf16 states, pairs of random bf16 values (finite as bf16 and as fp32)."""
    rng = np.random.default_rng(seed)
    if layout.state_dtype == "float32":
        return jnp.asarray(rng.standard_normal((layout.num_units, layout.unit_elems)), jnp.float32)
    pairs = jnp.asarray(rng.standard_normal((layout.num_units, layout.unit_elems * 2)), jnp.bfloat16)
    return pack_words(pairs)


def batch_bases(layout):
    """Rows: continuing in its own slot; fresh; copy-on-write from a checkpoint slot; two padding rows."""
    su, top = layout.slot_units, layout.scratch_slot
    own, fresh_slot, ckpt, work = top - su, top - 2 * su, top - 3 * su, top - 4 * su
    read = jnp.asarray([own, -1, ckpt, -1, -1], jnp.int32)
    write = jnp.asarray([own, fresh_slot, work, top, top], jnp.int32)
    return read, write


def test_slot_packs_layers_back_to_back(layout):
    assert layout.slot_units == -(-layout.slot_words // layout.unit_elems)
    rw = layout.row_width
    assert layout.unit_elems % rw == 0 and layout.state_words % rw == 0 and layout.conv_words % rw == 0
    # a stored state is N x K x V values of its dtype: bf16 pairs share a word
    assert layout.state_words * 4 == math.prod(layout.state_shape[1:]) * jnp.dtype(layout.state_dtype).itemsize


def test_gather_then_scatter_round_trips_every_layer(layout):
    arena = random_arena(layout, 1)
    read, write = batch_bases(layout)
    fresh = read < 0
    base = jnp.where(fresh, write, read)
    convs, states = gather_states(arena, layout, base, fresh)
    assert float(jnp.abs(states[0][1]).max()) == 0.0 and float(jnp.abs(states[0][0]).max()) > 0.0
    out = scatter_states(arena, layout, base[:3], [c[:3] for c in convs], [s[:3] for s in states])
    for j in range(layout.num_kda_layers):
        c2, s2 = gather_states(out, layout, base[:3], fresh[:3])
        np.testing.assert_array_equal(np.asarray(s2[j]), np.asarray(states[j][:3]))
        np.testing.assert_array_equal(np.asarray(c2[j]), np.asarray(convs[j][:3]))
        np.testing.assert_array_equal(np.asarray(read_conv(out, layout, j, base[:3], fresh[:3])),
                                      np.asarray(convs[j][:3]))


@pytest.mark.parametrize("rows", [1, 3])
def test_layer_by_layer_writes_equal_the_whole_slot_scatter(layout, rows):
    """Paged decode's batched KDA path writes each layer's new states when the layer runs
    (`write_layer_states`); after every layer the arena equals one whole-slot `scatter_states`, and
    units outside the rows' working slots are untouched."""
    arena = random_arena(layout, 3)
    read, write = batch_bases(layout)
    fresh = read < 0
    base = jnp.where(fresh, write, read)[:rows]
    rng = np.random.default_rng(4)
    _, n, k, v = layout.state_shape
    convs = [jnp.asarray(rng.standard_normal((rows, *layout.conv_shape[1:])), jnp.float32)
             for _ in range(layout.num_kda_layers)]
    states = [jnp.asarray(rng.standard_normal((rows, n, k, v)), jnp.float32) for _ in range(layout.num_kda_layers)]
    layered = arena
    for j in range(layout.num_kda_layers):
        c, st = read_layer_states(layered, layout, j, base, fresh[:rows])
        g = gather_states(layered, layout, base, fresh[:rows])
        np.testing.assert_array_equal(np.asarray(st), np.asarray(g[1][j]))
        np.testing.assert_array_equal(np.asarray(c), np.asarray(g[0][j]))
        layered = write_layer_states(layered, layout, j, write[:rows], convs[j], states[j])
    whole = scatter_states(arena, layout, write[:rows], convs, states)
    su, ue = layout.slot_units, layout.unit_elems
    slot_words = np.zeros(layout.num_units, bool)
    for b in np.asarray(write[:rows]):
        slot_words[b:b + su] = True
    got, want, old = (np.asarray(x) for x in (layered, whole, arena))
    # the whole-slot scatter also zero-fills the slot's padding words; the layered writes leave them
    used = np.zeros((layout.num_units, ue), bool)
    for b in np.asarray(write[:rows]):
        used[b:b + su].reshape(-1)[:layout.slot_words] = True
    np.testing.assert_array_equal(got[used], want[used])
    np.testing.assert_array_equal(got[~slot_words], old[~slot_words])


@pytest.mark.parametrize("j", [0, -1])
def test_in_place_row_update_matches_the_dense_path(layout, j):
    j = j % layout.num_kda_layers
    arena = random_arena(layout, 2)
    read, write = batch_bases(layout)
    fresh = read < 0
    b = read.shape[0]
    _, n, kd, vd = layout.state_shape
    ks = jax.random.split(jax.random.PRNGKey(3), 6)
    l2 = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    q, k = l2(jax.random.normal(ks[0], (b, n, kd))), l2(jax.random.normal(ks[1], (b, n, kd)))
    v = jax.random.normal(ks[2], (b, n, vd))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (b, n, kd)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, n)))
    windows = jax.random.normal(ks[5], (b, *layout.conv_shape[1:]))

    def update(i, state):
        return kda_token_step(state, q[i], k[i], v[i], g[i], beta[i])

    step = jax.jit(lambda a: update_states_in_place(a, layout, j, jnp.where(fresh, write, read), write, fresh,
                                                    windows, update))
    new, out = step(arena)

    _, states = gather_states(arena, layout, jnp.where(fresh, write, read), fresh)
    o_ref, s_ref = kda_token_step(states[j], q, k, v, g, beta)
    np.testing.assert_allclose(np.asarray(out), np.asarray(o_ref), rtol=1e-5, atol=1e-6)
    conv, got = gather_states(new, layout, write, jnp.zeros_like(fresh))
    if layout.state_dtype == "bfloat16":  # stored rounded: exactly the bf16 value of the new state
        s_ref = s_ref.astype(jnp.bfloat16).astype(jnp.float32)
    for r in range(3):  # real rows: layer j of the working slot holds the new state and windows
        np.testing.assert_allclose(np.asarray(got[j][r]), np.asarray(s_ref[r]), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(conv[j][r]), np.asarray(windows[r]))

    # nothing else changed: every word outside layer j of the three working slots and the scratch slot
    ue, le = layout.unit_elems, layout.layer_words
    touched = np.zeros(layout.num_units * ue, bool)
    for w in np.asarray(write):
        touched[w * ue + j * le:w * ue + (j + 1) * le] = True
    touched[layout.scratch_slot * ue:] = True
    np.testing.assert_array_equal(np.asarray(new).reshape(-1)[~touched], np.asarray(arena).reshape(-1)[~touched])
    # the checkpoint slot read by row 2 is untouched and its state was the one used
    assert math.isclose(float(jnp.abs(states[j][2]).sum()),
                        float(jnp.abs(gather_states(new, layout, read[2:3], fresh[2:3])[1][j]).sum()))


@pytest.mark.parametrize("ranks", [2, 4])
def test_context_shares_attend_as_the_whole_context(ranks):
    """Decode context parallelism (serve/step.py): rank r's share of a context is every `ranks`-th token of
    each page from offset r. Storing a chunk into each share (tokens crossing page ends, padding, rows of
    different lengths) gives the whole context's contents and causal mask at the share's positions, and
    attention over the shares combined over the ranks (here a vmapped axis) is the one-softmax attention."""
    from k3jax.cache import append_latents
    from k3jax.layers.mla import NEG_INF
    from serve.step import append_rank_latents, attend_share

    rng = np.random.default_rng(ranks)
    b, pages, ps, t, w, nh, r = 3, 4, 8, 11, 12, 4, 8  # latent words w = r + rope 4
    kv = jnp.asarray(rng.standard_normal((b, pages * ps, w)), jnp.float32)
    words = jnp.asarray(rng.standard_normal((b, t, w)), jnp.float32)
    lengths, valid = jnp.asarray([0, 5, 19], jnp.int32), jnp.asarray([11, 0, 7], jnp.int32)
    whole, mask = append_latents(kv, words, lengths, valid)  # [B, S, w], [B, T, S]
    by_rank = lambda x: x.reshape(*x.shape[:-2], pages, ps // ranks, ranks, x.shape[-1])  # noqa: E731
    share_of = lambda x, k: by_rank(x)[..., k, :].reshape(*x.shape[:-2], -1, x.shape[-1])  # noqa: E731
    shares, masks = zip(*[append_rank_latents(share_of(kv, k), words, lengths, valid, ps, ranks, jnp.int32(k))
                          for k in range(ranks)])
    for k in range(ranks):
        np.testing.assert_array_equal(shares[k], share_of(whole, k))
        held = share_of(jnp.arange(pages * ps)[None, :, None], k)[0, :, 0]  # positions the share holds
        np.testing.assert_array_equal(masks[k], mask[:, :, held])
    q = jnp.asarray(rng.standard_normal((b, t, nh, w)), jnp.float32)
    scores = jnp.where(mask[:, None], jnp.einsum("bthr,bsr->bhts", q, whole) * 0.3, NEG_INF)
    want = jnp.einsum("bhts,bsr->bthr", jax.nn.softmax(scores, axis=-1), whole)[..., :r]  # [B, T, nh, r]
    assert float(jnp.abs(want).max()) > 0.1
    for by_head in (False, True):
        got = jax.vmap(lambda s, m: attend_share(s, m, q, r, 0.3, "ranks", by_head), axis_name="ranks")(
            jnp.stack(shares), jnp.stack(masks))
        for k in range(ranks):  # every rank ends with the whole result, or with its own heads' part
            part = want[:, :, k * nh // ranks:(k + 1) * nh // ranks] if by_head else want
            np.testing.assert_allclose(got[k], part, rtol=2e-5, atol=2e-6)
