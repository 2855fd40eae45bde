"""Probabilistic drafting with a sparse, exactly transmitted proposal distribution.

Lossless rejection sampling (services/attention/sampling/verify.py) needs, at every draft slot,
the exact distribution q the draft was drawn from. The drafter's Markov-corrected softmax has
a full vocabulary (129,280 floats per slot on V4-Flash): too large for the control plane, which
the torch-free router relays. So the drafter draws from a sparse q instead: the
`max_support` most probable tokens of softmax((U_k + W1[x_{k-1}] W2) / T), renormalised, and
exactly zero elsewhere. Any q keeps rejection sampling lossless as long as the verifier uses the
same q; the truncation only lowers acceptance by the tail mass it drops. q travels as
(token ids, float32 probabilities) per slot, and a float32 survives msgpack's float64 exactly,
so the verifier rebuilds the very tensor the draft was sampled from (`dense_distribution`).

The random draw is keyed by (seed, Purpose.DRAFT, output position) — its own purpose, so
the draft is independent of the verifier's accept and resample noise (docs/speculation.md §6.5):
- max_support None (full q): `sample_from_probs` on the dense q with the key's stream, exactly the
  tokens `DSparkDrafter.sampled_chain` draws;
- truncated q: an exponential race over the support only, `support_draw`: the key's first S
  Exp(1) draws (`rng.key_exponentials`, plain tensor arithmetic on the key) go to the support tokens
  in ascending id order and the token with the largest q / E wins. That is a draw from q (the race's
  winner has probability q_v / Σq), it is reproducible and batch-independent (the key and the support
  order are the request's own), it draws S exponentials instead of V, and it needs no generator, so
  the drafter's CUDA graphs draw sampled chains inside the replay (draft_graphs.py). A chain's keys
  are known before it starts, so the batched chains draw every slot's exponentials in one go.
The truncated q is computed from the logits alone (`top_support`): the S largest logits (ranked by
`support_keys`: by logit, the lower token id first among equal logits, so the set is unique and the kernel
of the drafter's graphs, common/kernels/draft_support.py, picks the same one) and a softmax over those S
values / T. Renormalising a full softmax over its S largest entries gives the same distribution (the
vocabulary's normaliser cancels), so no [V] softmax is needed for a sampled slot.
Legend: G slots, V vocab, S support size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moemesh.common.model.dspark import DSparkDrafter
from moemesh.common.sampling.draw import sample_from_probs
from moemesh.common.sampling.rng import Purpose, key_exponentials, signed_key, stream


@dataclass(frozen=True)
class SparseDraftChain:
    """token_ids [G] int64; probs [G] q(token) fp32; confidences [G]; support_ids / support_probs:
    per slot the S_k tokens with q > 0 and their q (fp32, summing to 1 up to rounding)."""

    token_ids: torch.Tensor
    probs: torch.Tensor
    confidences: torch.Tensor
    support_ids: tuple[torch.Tensor, ...]
    support_probs: tuple[torch.Tensor, ...]


def truncated_distribution(logits: torch.Tensor, temperature: float, max_support: int | None) -> torch.Tensor:
    """logits [V] -> dense q [V] fp32: softmax(logits / T), kept on its max_support largest
    entries and renormalised (None: the full softmax, untouched); the values `top_support` gives."""
    scaled = logits.float() / temperature  # [V]
    if max_support is None or max_support >= scaled.shape[-1]:
        return torch.softmax(scaled, dim=-1)
    ids, probs = top_support(logits[None], torch.tensor([[temperature]], device=logits.device), max_support)  # [1, S]
    return torch.zeros_like(scaled).scatter_(0, ids[0], probs[0])


def dense_distribution(support_ids: Sequence[int], support_probs: Sequence[float], vocab_size: int,
                       device: torch.device | str = "cpu") -> torch.Tensor:
    """The verifier's side: one slot's sparse q (as sent in DraftProposal) -> dense [V] fp32."""
    dense = torch.zeros(vocab_size, dtype=torch.float32, device=device)
    dense[torch.tensor(list(support_ids), dtype=torch.long, device=device)] = torch.tensor(
        list(support_probs), dtype=torch.float32, device=device)
    return dense


def support_draw(support_ids: torch.Tensor, support_probs: torch.Tensor, keys: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from a sparse q. support_ids [R, S] ascending, support_probs [R, S] (q on
    them; zeros allowed, never drawn), keys [R] int64 (`rng.signed_key` of each row's (seed, DRAFT,
    position)). Returns (token ids [R], their q [R])."""
    return exponential_race(support_ids, support_probs, key_exponentials(keys, support_ids.shape[1]))


def exponential_race(support_ids: torch.Tensor, support_probs: torch.Tensor, noise: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """`support_draw` with the Exp(1) draws given: noise [R, S] (`key_exponentials` of the rows' keys) ->
    (token ids [R], their q [R])."""
    pick = (support_probs.float() / noise).argmax(dim=-1, keepdim=True)  # [R, 1]
    return support_ids.gather(1, pick).squeeze(1), support_probs.gather(1, pick).squeeze(1)


def sparse_slot_draw(logits: torch.Tensor, divisors: torch.Tensor, noise: torch.Tensor, support_k: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One slot of sampled rows: logits [R, V] (Markov-corrected), divisors [R, 1] (temperatures), noise [R, K]
    (the slot's Exp(1) draws: `key_exponentials` of the rows' DRAFT keys) -> (support ids [R, K] ascending, their
    q [R, K], the drawn token [R], its q [R]), q being the top support_k of softmax(logits / T) renormalised.
    `batched_chains` draws with it; the drafter's graphs (draft_graphs.py) with its kernel on CUDA
    (common/kernels/draft_support.py)."""
    ids, values = top_support(logits, divisors, support_k)
    drawn, drawn_q = exponential_race(ids, values, noise)
    return ids, values, drawn, drawn_q


def draft_keys(seeds: Sequence[int], first_positions: Sequence[int], num_slots: int,
               device: torch.device | str) -> torch.Tensor:
    """[R, G] int64: the DRAFT key of every row's slots (row r, slot k: position first_positions[r] + k)."""
    return torch.tensor([[signed_key(int(seed), Purpose.DRAFT, int(position) + k) for k in range(num_slots)]
                         for seed, position in zip(seeds, first_positions)], dtype=torch.int64).to(device)


def support_keys(logits: torch.Tensor) -> torch.Tensor:
    """logits [R, V] fp32 -> int64 keys [R, V], one per token, larger for a larger logit and, among equal logits,
    for the lower token id: ordered(logit) · 2³² + (2³² - 1 - id), ordered() the float's bits as a signed integer
    of the same order. Their top S is a unique set (torch.topk leaves ties at the S-th place to the device)."""
    bits = logits.float().contiguous().view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()  # [R, V]
    ids = torch.arange(logits.shape[-1], dtype=torch.int64, device=logits.device)
    return ordered * (1 << 32) + ((1 << 32) - 1 - ids)


def top_support(logits: torch.Tensor, divisors: torch.Tensor, max_support: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V], divisors [R, 1] (temperatures) -> the truncated q: the max_support largest logits
    (`support_keys`), ids ascending, and softmax over them / T (= softmax(logits / T) over the vocabulary kept
    on those entries and renormalised): (ids [R, S], probs [R, S] fp32)."""
    logits = logits.float()
    keys = torch.topk(support_keys(logits), max_support, dim=-1).values  # [R, S]
    ids = ((1 << 32) - 1 - (keys & 0xFFFFFFFF)).sort(dim=-1).values  # [R, S] ascending
    return ids, torch.softmax(logits.gather(1, ids) / divisors, dim=-1)


@torch.no_grad()
def sparse_sampled_chain(drafter: DSparkDrafter, base_logits: torch.Tensor, hidden: torch.Tensor,
                         seed_token_id: int, *, temperature: float, seed: int, output_positions: Sequence[int],
                         max_support: int | None) -> SparseDraftChain:
    """Left to right over the G slots: q_k from the Markov-corrected logits given x_{k-1}
    (x_0 = seed token), x_k ~ q_k from stream (seed, DRAFT, output_positions[k]),
    c_k = confidence(h_k, W1[x_{k-1}]). base_logits [G, V], hidden [G, D] (pre-norm)."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 (greedy requests use greedy_chain)")
    num_slots = base_logits.shape[0]
    if len(output_positions) != num_slots:
        raise ValueError(f"{len(output_positions)} output positions for {num_slots} slots")
    device = base_logits.device
    token_ids = torch.empty(num_slots, dtype=torch.long, device=device)
    chosen_probs = torch.empty(num_slots, dtype=torch.float32, device=device)
    confidences = torch.empty(num_slots, dtype=torch.float32, device=device)
    support_ids, support_probs = [], []
    prev = torch.tensor(seed_token_id, device=device)
    for k in range(num_slots):
        logits, embedding = drafter.markov_logits(base_logits[k], prev)  # [V], [r]
        confidences[k] = drafter.confidence(hidden[k], embedding)
        if max_support is None or max_support >= logits.shape[0]:
            q = truncated_distribution(logits, temperature, None)  # [V]
            generator = stream(seed, Purpose.DRAFT, int(output_positions[k]), device)
            token = int(sample_from_probs(q[None], [generator])[0])
        else:
            top_ids, top_probs = top_support(logits[None], torch.tensor([[float(temperature)]], device=device),
                                             max_support)
            q = torch.zeros(logits.shape[0], dtype=torch.float32, device=device).scatter_(0, top_ids[0], top_probs[0])
            keys = draft_keys([seed], [int(output_positions[k])], 1, device)[:, 0]  # [1]
            token = int(support_draw(top_ids, top_probs, keys)[0][0])
        ids = torch.nonzero(q, as_tuple=True)[0]  # [S] ascending
        token_ids[k] = token
        chosen_probs[k] = q[token]
        support_ids.append(ids)
        support_probs.append(q[ids])
        prev = torch.tensor(token, device=device)
    return SparseDraftChain(token_ids, chosen_probs, confidences, tuple(support_ids), tuple(support_probs))


@dataclass(frozen=True)
class RowChains:
    """The chains of A drafted requests from one batched pass (`batched_chains`), on the host.

    token_ids / chosen_probs / confidences: per request, G values. chosen_probs: the
    probability of the drafted token under the distribution it came from (greedy rows: the
    temperature-1 softmax, as `DSparkDrafter.greedy_chain`; sampled rows: q). support_ids /
    support_probs: per request, per slot, the sparse q (empty tuples for greedy rows), ids
    ascending like `sparse_sampled_chain`'s.
    """

    token_ids: list[list[int]]
    chosen_probs: list[list[float]]
    confidences: list[list[float]]
    support_ids: list[list[tuple[int, ...]]]
    support_probs: list[list[tuple[float, ...]]]


def greedy_slot(drafter: DSparkDrafter, base_logits: torch.Tensor, hidden: torch.Tensor, prev: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One slot of A chains, on the device: base_logits [A, V], hidden [A, D] (pre-norm), prev [A] the previous
    tokens -> (argmax token [A], its probability at temperature 1 [A], confidence [A] fp32, the Markov-corrected
    logits [A, V] fp32). What greedy rows keep; also inside the drafter's CUDA graphs (draft_graphs.py)."""
    logits, confidence = markov_slot(drafter, base_logits, hidden, prev)  # [A, V] fp32, [A]
    token = logits.argmax(dim=-1)  # [A]
    chosen = torch.softmax(logits, dim=-1).gather(1, token[:, None]).squeeze(1)  # [A]
    return token, chosen, confidence, logits


def markov_slot(drafter: DSparkDrafter, base_logits: torch.Tensor, hidden: torch.Tensor, prev: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One slot of A chains before any choice: base_logits [A, V], hidden [A, D] (pre-norm), prev [A] ->
    (Markov-corrected logits [A, V] fp32, confidence [A] fp32)."""
    logits, embedding = drafter.markov_logits(base_logits, prev)  # [A, V] fp32, [A, r]
    return logits, drafter.confidence(hidden, embedding).float()


@torch.no_grad()
def batched_chains(drafter: DSparkDrafter, base_logits: torch.Tensor, hidden: torch.Tensor,
                   seed_token_ids: Sequence[int], temperatures: Sequence[float], seeds: Sequence[int | None],
                   first_output_positions: Sequence[int | None], max_support: int | None) -> RowChains:
    """All A requests' chains together, slot by slot: the same tokens, q and confidences as
    `DSparkDrafter.greedy_chain` (temperature 0) and `sparse_sampled_chain` (temperature > 0)
    per request, but G steps of [A, V] work instead of A·G steps of [V] work, and no host sync
    inside the loop (greedy tokens stay on the device; each sampled draw uses its own row's
    generator, so a row's draw does not depend on the batch). One transfer to the host at the end.

    base_logits [A, G, V], hidden [A, G, D] (pre-norm); temperatures[a] 0 marks a greedy row.
    """
    num_rows, num_slots, num_vocab = base_logits.shape
    device = base_logits.device
    temps = torch.tensor([float(t) for t in temperatures], dtype=torch.float32, device=device)  # [A]
    sampled = [a for a in range(num_rows) if temperatures[a] > 0]
    for a in sampled:
        if seeds[a] is None or first_output_positions[a] is None:
            raise ValueError(f"row {a}: a sampled chain needs a seed and a first output position")
    sampled_index = torch.tensor(sampled, dtype=torch.long, device=device)
    support_k = num_vocab if max_support is None else min(max_support, num_vocab)
    noise = None
    if sampled and support_k < num_vocab:  # [S, G, K]: every sampled row's draws for every slot, from its keys
        noise = key_exponentials(draft_keys([seeds[a] for a in sampled], [first_output_positions[a] for a in sampled],
                                            num_slots, device), support_k)
    all_sampled = len(sampled) == num_rows
    divisors = temps.index_select(0, sampled_index)[:, None]  # [S, 1]
    prev = torch.tensor([int(t) for t in seed_token_ids], dtype=torch.long, device=device)  # [A]
    tokens, chosen, confidences, top_ids, top_probs = [], [], [], [], []
    for k in range(num_slots):
        if all_sampled:  # no greedy row: its argmax and temperature-1 softmax are not needed
            logits, confidence = markov_slot(drafter, base_logits[:, k], hidden[:, k], prev)  # [A, V], [A]
        else:  # greedy rows keep token and chosen_k (temperature-1 probability)
            token, chosen_k, confidence, logits = greedy_slot(drafter, base_logits[:, k], hidden[:, k], prev)
        confidences.append(confidence)
        if sampled:
            rows_logits = logits if all_sampled else logits.index_select(0, sampled_index)  # [S, V]
            if noise is not None:
                ids, values, drawn, drawn_q = sparse_slot_draw(rows_logits, divisors, noise[:, k], support_k)
            else:  # full q: the dense draw, as DSparkDrafter.sampled_chain
                q = torch.softmax(rows_logits / divisors, dim=-1)  # [S, V]
                generators = [stream(int(seeds[a]), Purpose.DRAFT, int(first_output_positions[a]) + k, device)
                              for a in sampled]
                ids = torch.arange(num_vocab, device=device).expand(len(sampled), -1)
                values = q
                drawn = sample_from_probs(q, generators)  # [S]
                drawn_q = q.gather(1, drawn[:, None]).squeeze(1)
            if all_sampled:
                token, chosen_k = drawn, drawn_q
            else:
                token = token.index_copy(0, sampled_index, drawn)
                chosen_k = chosen_k.index_copy(0, sampled_index, drawn_q)
            top_ids.append(ids)
            top_probs.append(values)
        tokens.append(token)
        chosen.append(chosen_k)
        prev = token
    token_rows = torch.stack(tokens, dim=1).tolist()  # [A, G]; the one host sync of the chains
    chosen_rows = torch.stack(chosen, dim=1).tolist()
    confidence_rows = torch.stack(confidences, dim=1).tolist()
    support_ids = support_probs = []
    if sampled:  # [S, G, K] each
        support_ids, support_probs = torch.stack(top_ids, dim=1).tolist(), torch.stack(top_probs, dim=1).tolist()
    support_ids, support_probs = _host_supports(support_ids, support_probs, sampled, num_rows, num_slots)
    return RowChains(token_rows, chosen_rows, confidence_rows, support_ids, support_probs)


def _host_supports(ids_host: list, probs_host: list, sampled_rows: Sequence[int], num_rows: int, num_slots: int
                   ) -> tuple[list, list]:
    """The sampled rows' sparse q on the host: ids_host / probs_host nested lists [S, G, K] (ids ascending within a
    slot, as ints or as the floats of a packed read-back) of rows `sampled_rows` -> per row of num_rows, per slot,
    (ids, probs) tuples kept where q > 0 (empty for the rest)."""
    support_ids = [[() for _ in range(num_slots)] for _ in range(num_rows)]
    support_probs = [[() for _ in range(num_slots)] for _ in range(num_rows)]
    for row, a in enumerate(sampled_rows):
        for k in range(num_slots):
            slot_ids, slot_probs = ids_host[row][k], probs_host[row][k]
            if min(slot_probs) > 0:  # the common case: every entry is support
                support_ids[a][k], support_probs[a][k] = tuple(map(int, slot_ids)), tuple(slot_probs)
                continue
            kept = [(int(i), q) for i, q in zip(slot_ids, slot_probs) if q > 0]  # q = 0: not support
            support_ids[a][k] = tuple(i for i, _ in kept)
            support_probs[a][k] = tuple(q for _, q in kept)
    return support_ids, support_probs


def replay_row_chains(chains: torch.Tensor, support_ids: torch.Tensor | None, support_probs: torch.Tensor | None,
                      sampled: Sequence[bool]) -> RowChains:
    """A drafter graph's chains (draft_graphs.py) -> the RowChains `batched_chains` gives, in one transfer.
    chains [A, G, 3] fp32 (token id, its probability, confidence per slot); support_ids / support_probs
    [A, G, K] (the sparse q of every slot, ids ascending; None when no row samples); sampled[a]: row a drew
    its tokens (its support kept where q > 0), else a greedy row (empty supports). With supports, one fp32
    [A, G, 3 + 2K] read-back carries all of it (token ids are exact in fp32 below 2**24)."""
    sampled_rows = [a for a, flag in enumerate(sampled) if flag]
    num_rows, num_slots = chains.shape[0], chains.shape[1]
    if not sampled_rows:
        rows = chains.tolist()  # [A, G, 3]
        support_id_rows, support_prob_rows = _host_supports([], [], [], num_rows, num_slots)
    else:
        support_k = support_ids.shape[2]
        packed = torch.cat([chains, support_ids.float(), support_probs.float()], dim=-1).tolist()  # [A, G, 3 + 2K]
        rows = packed
        support_id_rows, support_prob_rows = _host_supports(
            [[slot[3:3 + support_k] for slot in packed[a]] for a in sampled_rows],
            [[slot[3 + support_k:] for slot in packed[a]] for a in sampled_rows], sampled_rows, num_rows, num_slots)
    return RowChains([[int(slot[0]) for slot in row] for row in rows], [[slot[1] for slot in row] for row in rows],
                     [[slot[2] for slot in row] for row in rows], support_id_rows, support_prob_rows)
