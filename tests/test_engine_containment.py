"""A request the model step fails on fails alone: the engine finishes it with
an error, frees its pages and keeps serving the requests that shared its batch."""

from __future__ import annotations

from engine_utils import add, make_engine, run_to_end

from tokenrouter.sampling_params import SamplingParams


def test_step_failure_fails_only_its_request(model_paths):
    eng = make_engine(model_paths["llama"])
    good = add(eng, [[1, 2, 3, 4, 5], [6, 7, 8]], max_tokens=6, ignore_eos=True)
    # top_k past int64: SamplingParams accepts it, the sampler's tensor cannot hold it. The HTTP edge
    # refuses it (see test_server_hardening), but the engine must contain whatever gets through.
    bad = eng.add_request([9, 10, 11], SamplingParams(max_tokens=6, temperature=1.0, top_k=2**63,
                                                      ignore_eos=True))
    first = eng.step()
    assert bad in first.finished and bad.finish_reason == "error"
    assert not any(r in first.finished for r in good)
    eng.check_integrity()
    run_to_end(eng)
    for r in good:
        assert r.finish_reason == "length" and r.num_output == 6
    assert eng.pool.num_free + eng.cache.total_pages == eng.pool.num_pages  # no page held by anyone


def test_same_tokens_as_without_the_failing_request(model_paths):
    # The requests that shared the failed batch run again from where they were: same output.
    ref = make_engine(model_paths["llama"])
    expected = add(ref, [[1, 2, 3, 4, 5]], max_tokens=5, ignore_eos=True, temperature=0.8, seed=3)
    run_to_end(ref)
    eng = make_engine(model_paths["llama"])
    got = add(eng, [[1, 2, 3, 4, 5]], max_tokens=5, ignore_eos=True, temperature=0.8, seed=3)
    eng.add_request([9, 10], SamplingParams(max_tokens=5, top_k=2**63))
    run_to_end(eng)
    assert got[0].output_ids == expected[0].output_ids
