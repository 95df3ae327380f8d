"""The token-budget split: padded forward batches and token-sum requests, in order."""

from dfp_shared.hidden_states import padded_batches, plan_batches, plan_requests


def test_padded_batches_count_rows_times_longest():
    assert plan_batches([4, 4, 4, 8, 1], 12) == [[0, 1, 2], [3], [4]]
    assert plan_batches([20, 1], 8) == [[0], [1]]  # a sequence over the budget goes alone


def test_the_first_padded_batch_reads_one_length_past_it():
    read = []

    def lengths():
        for n in [3, 3, 3, 3, 3]:
            read.append(n)
            yield n

    assert next(padded_batches(lengths(), 6)) == [0, 1]
    assert len(read) == 3


def test_requests_count_tokens_only():
    assert plan_requests([4, 4, 4, 8, 1], 12) == [[0, 1, 2], [3, 4]]
    assert plan_requests([20, 1], 8) == [[0], [1]]
    assert plan_requests([5, 5, 5], None) == [[0, 1, 2]]
    assert plan_requests([5, 5, 5], 0) == [[0, 1, 2]]
    assert plan_requests([], 8) == []
