"""lm-evaluation-harness's ``local-completions`` model against a real uvicorn server with the fake engine (its
tokenizer through /tokenize, /detokenize, /tokenizer_info): loglikelihood and greedy flags equal what the fake
engine's logprobs imply, generate_until stops where asked. Skipped without the ``eval`` extra. The end-to-end run
on the default model is scripts/lm_eval_check.sh."""

from __future__ import annotations


import pytest

from parrot.api import ServerSettings, create_app
from fakes import FakeEngine
from servers import serve

pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")


@pytest.fixture(scope="module")
def base_url():
    with serve(create_app(ServerSettings(engine_heartbeat_s=0), [FakeEngine(max_model_len=512)])) as url:
        yield url


@pytest.fixture(scope="module")
def lm(base_url):
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    return LocalCompletionsAPI(model="fake-model", base_url=f"{base_url}/v1/completions", tokenizer_backend="auto",
                               max_retries=1, max_length=512)


def instance(kind: str, args: tuple, idx: int = 0):
    from lm_eval.api.instance import Instance

    return Instance(request_type=kind, doc={}, arguments=args, idx=idx)


def test_remote_tokenizer_is_detected_and_matches_the_engine(lm):
    assert lm.tokenizer_backend == "remote"
    assert lm.tok_encode("héllo") == FakeEngine.encode("héllo")  # add_special_tokens false: no BOS
    assert lm.tokenizer.decode(FakeEngine.encode("héllo")) == "héllo"


def test_loglikelihood_and_greedy_flags(lm):
    # "cd" after "ab": each byte is its predecessor + 1, the fake engine's most likely token (greedy)
    got = lm.loglikelihood([instance("loglikelihood", ("ab", "cd")), instance("loglikelihood", ("ab", "xz"), 1)],
                           disable_tqdm=True)
    ids = FakeEngine.encode("abcd")
    want = FakeEngine.fake_logprob(ids[2], ids[1]) + FakeEngine.fake_logprob(ids[3], ids[2])
    assert got[0][0] == pytest.approx(want) and got[0][1] is True
    ids = FakeEngine.encode("abxz")
    want = FakeEngine.fake_logprob(ids[2], ids[1]) + FakeEngine.fake_logprob(ids[3], ids[2])
    assert got[1][0] == pytest.approx(want) and got[1][1] is False


def test_generate_until(lm):
    out = lm.generate_until([instance("generate_until", ("Q: hi", {"until": ["\n"], "max_gen_toks": 20}))],
                            disable_tqdm=True)
    assert out == [FakeEngine.reply_for("Q: hi")]
