"""TokenCounts: the penalties' per-sequence rows, kept up to date by each step's tokens."""

import torch

from kiln.engine.request import Request, Status
from kiln.engine.token_counts import TokenCounts
from kiln.ops.sampling_metadata import Penalties, token_counts
from kiln.sampling_params import SamplingParams

VOCAB = 50
CPU = torch.device("cpu")
PENALISED = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5)


def request(rid: str, prompt: list[int], output: list[int], params: SamplingParams) -> Request:
    return Request(rid, rid, params, prompt + output, len(prompt), 64, text=None)  # type: ignore[arg-type]


def expected(reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference, built from the whole ids; zero rows for requests without penalties."""
    users = [r if r.params.uses_penalties else None for r in reqs]
    prompt = token_counts([r.prompt_token_ids if r else [] for r in users], VOCAB, CPU) > 0
    return prompt, token_counts([r.output_token_ids if r else [] for r in users], VOCAB, CPU)


def sample(counts: TokenCounts, reqs: list[Request], sampled: list[int]) -> None:
    """A step: its penalties equal the reference's, then each request takes its sampled token."""
    pen = counts.penalties(reqs)
    assert pen is not None
    prompt, output = expected(reqs)
    assert torch.equal(pen.prompt_mask, prompt) and torch.equal(pen.output_counts, output)
    counts.update(torch.tensor(sampled))
    for r, t in zip(reqs, sampled, strict=True):
        r.token_ids.append(t)


def test_rows_follow_sampled_tokens_free_rows_are_rebuilt_and_other_rows_read_zeros() -> None:
    counts = TokenCounts(VOCAB, CPU, max_seqs=16)
    a = request("a", [1, 2, 2], [5], PENALISED)
    free = request("free", [3, 5], [9], SamplingParams())
    c = request("c", [4, 4], [7, 7], PENALISED)
    reqs = [a, free, c]
    for sampled in ([9, 9, 7], [5, 1, 7], [9, 9, 2]):
        sample(counts, reqs, sampled)

    # A finished sequence's row goes to the next one, rebuilt from that one's ids alone.
    a.status = Status.FINISHED
    d = request("d", [8], [3, 3, 3], PENALISED)
    reqs = [d, free, c]
    pen = counts.penalties(reqs)
    assert pen is not None and counts.rows[d] == 1 and len(counts.rows) == 2
    prompt, output = expected(reqs)
    assert torch.equal(pen.prompt_mask, prompt) and torch.equal(pen.output_counts, output)

    # Filling every row keeps each one's counts.
    more = [request(f"m{i}", [i], [i + 1] * i, PENALISED) for i in range(14)]
    reqs = [d, free, c, *more]
    pen = counts.penalties(reqs)
    assert pen is not None
    prompt, output = expected(reqs)
    assert torch.equal(pen.prompt_mask, prompt) and torch.equal(pen.output_counts, output)
    assert counts.penalties([free]) is None


def test_rows_are_made_once_for_a_full_step_and_a_preempted_sequence_gives_its_row_up() -> None:
    """The memory profile sets aside `nbytes` for the rows; they never grow past it. Two rows (max_seqs 2)
    serve three sequences that take turns, as preemption makes them: a row is rebuilt from the ids of the
    sequence that takes it, and the one it was taken from is rebuilt when it samples again."""
    counts = TokenCounts(VOCAB, CPU, max_seqs=2)
    a, b, c = (request(n, [i, i + 1], [i + 2] * i, PENALISED) for i, n in enumerate("abc", 1))
    for step, sampled in (([a, b], [7, 8]), ([c, a], [9, 7]), ([b, c], [8, 9]), ([a, b], [1, 2])):
        sample(counts, step, sampled)
        held = counts.prompt.numel() + counts.counts.element_size() * counts.counts.numel()
        assert len(counts.rows) == 2 and held == TokenCounts.nbytes(VOCAB, 2)


def test_warmups_penalties_have_the_layout_of_servings() -> None:
    """Warmup builds the Triton prep kernel from Penalties.from_ids; a step takes TokenCounts' rows. Triton
    builds a kernel per divisibility of its int arguments (the rows' strides among them), so the two must
    lay their rows out alike, or the first penalised request after ready builds another."""
    reqs = [request("a", [1, 2], [3], PENALISED), request("b", [4], [], PENALISED)]
    serving = TokenCounts(VOCAB, CPU, max_seqs=2).penalties(reqs)
    warm = Penalties.from_ids([PENALISED] * 2, [[0]] * 2, [[]] * 2, VOCAB, CPU)
    assert serving is not None
    for name in ("prompt_mask", "output_counts"):
        assert getattr(warm, name).stride() == getattr(serving, name).stride() == (VOCAB, 1), name


def test_a_sequence_that_finished_after_scheduling_gets_no_row_back() -> None:
    """Under async scheduling a step may still hold a request that landing the last step finished: its row
    is freed, not rebuilt from its whole history (nor taken from a preempted sequence) for a dropped token."""
    counts = TokenCounts(VOCAB, CPU, max_seqs=2)
    a, b = request("a", [1, 2], [3], PENALISED), request("b", [4], [5, 5], PENALISED)
    sample(counts, [a, b], [6, 7])
    a.status = Status.FINISHED
    pen = counts.penalties([a, b])
    assert pen is not None and list(counts.rows) == [b] and counts.free == [1]
    assert not pen.output_counts[0].any()  # a reads the zero row
    assert torch.equal(pen.output_counts[1], expected([b])[1][0])
    counts.update(torch.tensor([9, 8]))
    assert counts.counts[1, 9] == 0 and counts.counts[counts.rows[b], 8] == 1  # a's dropped token uncounted
