"""The planner's memory model (``plan.memory.stage_memory``) against peaks worked out by hand from each
schedule's action order; ``benchmarks/realistic_llama.py --memory`` checks it against the allocator."""
import pytest

from lightning_async_pp.plan.memory import stage_memory
from lightning_async_pp.pipeline.simulate import simulate

# Per microbatch: it keeps S for its backward; its backward peaks at W beside existing gradients, at W1 (which
# includes allocating a gradient of G bytes) when it is its batch's first. Held throughout: weights G, state 2G.
G, S, W, W1 = 100, 30, 50, 140


def peak(schedule, device, p=2, m=2, **kwargs):
    result = simulate(schedule, p, m, [1.0] * p, [2.0] * p, **kwargs)
    return stage_memory(result, device, weight_bytes=G, saved_bytes=S, working_bytes=W, first_working_bytes=W1,
                        optimizer_state_bytes=2 * G)


def walk(actions):
    """The hand-worked rule over one device's action order: ("F", b), ("B", b), ("O", b)."""
    in_flight, graded, best = 0, set(), 0
    for op, b in actions:
        if op == "F":
            in_flight += 1
            best = max(best, len(graded) * G + in_flight * S)
        elif op == "B":
            working = W if b in graded else W1
            best = max(best, len(graded) * G + (in_flight - 1) * S + working)
            graded.add(b)
            in_flight -= 1
        else:
            best = max(best, len(graded) * G + in_flight * S)
            graded.discard(b)
    return best + G + 2 * G  # weights and optimizer state


def test_1f1b_first_device_peaks_at_its_first_backward_beside_the_other_microbatch_in_flight():
    # F0 F1 B0 B1 update: the peak is B0, the batch's first backward, with F1's activations kept.
    expected = walk([("F", 0), ("F", 1), ("B", 0), ("B", 0), ("O", 0)])
    assert expected == G + 2 * G + S + W1
    got = peak("1f1b", 0)
    assert got.total == expected
    assert (got.weights, got.versions, got.gradients, got.optimizer_state) == (G, 0, G, 2 * G)
    assert got.activations == S + W1 - G


def test_1f1b_first_device_at_m_4_holds_three_in_flight_beside_the_gradients():
    # This project's 1f1b warms stage 0 up with three forwards at p = 2 (the simulated order is checked here): after
    # B0 the gradients exist while two more microbatches stay in flight, and F3 makes it three again.
    result = simulate("1f1b", 2, 4, [1.0, 1.0], [2.0, 2.0])
    order = [(s.action or "O", s.batch) for s in result.timelines[0] if s.step == 1]
    assert order == [("F", 1), ("F", 1), ("F", 1), ("B", 1), ("F", 1), ("B", 1), ("B", 1), ("B", 1), ("O", 1)]
    got = peak("1f1b", 0, m=4)
    assert got.total == walk(order) == 3 * G + max(2 * S + W1, G + 3 * S, G + 2 * S + W)
    assert (got.gradients, got.activations) == (G, 2 * S + W)


def test_2bw_stashes_one_version_and_its_last_stage_holds_two_gradients_while_it_runs_ahead():
    # The last stage runs the next batch's first microbatch (forward and backward) before this batch's update:
    # two batches' gradients exist there. Without the run-ahead, one.
    ahead = peak("2bw", 1, steps=4)
    assert ahead.versions == G
    assert ahead.gradients == 2 * G
    assert ahead.total == G + G + 2 * G + walk([("F", 0), ("B", 0), ("F", 1), ("B", 1)]) - 3 * G
    plain = peak("2bw", 1, steps=4, last_ahead=False)
    assert plain.gradients == G
    assert plain.total == 4 * G + max(W1, G + S, G + W)  # F0 B0 F1 B1 update
    assert ahead.total == 4 * G + G + W1  # ... F0' B0' (the next batch's first, beside this batch's gradient) update


def test_the_optimizer_transient_counts_at_the_update():
    result = simulate("1f1b", 2, 2, [1.0, 1.0], [2.0, 2.0])
    big = stage_memory(result, 1, weight_bytes=G, saved_bytes=S, working_bytes=W, first_working_bytes=W1,
                       update_bytes=10 * G)
    assert big.total == G + G + 10 * G  # weights, the gradient and the copy at the update; nothing in flight


def test_chunked_schedules_charge_a_chunk_its_share_of_a_microbatch():
    result = simulate("interleaved_1f1b", 2, 4, [1.0, 1.0], [2.0, 2.0], virtual_stages=2)
    got = stage_memory(result, 0, weight_bytes=G, saved_bytes=S, working_bytes=W)
    one_chunk = stage_memory(result, 0, weight_bytes=G, saved_bytes=S * 2, working_bytes=W * 2)
    assert result.chunks == 2 and 0 < got.activations < one_chunk.activations


@pytest.mark.parametrize("bad, message", [
    (dict(device=2), "device 2 is not one of the 2"),
    (dict(saved_bytes=-1), "saved_bytes must be >= 0, got -1"),
    (dict(update_bytes=-5), "update_bytes must be >= 0, got -5"),
])
def test_bad_input_names_the_value(bad, message):
    result = simulate("1f1b", 2, 2, [1.0, 1.0], [2.0, 2.0])
    kwargs = dict(device=0, weight_bytes=G, saved_bytes=S, working_bytes=W) | bad
    with pytest.raises(ValueError, match=message):
        stage_memory(result, **kwargs)
