"""Resource safety: loading never runs code from a file, and a long run of requests does not grow memory."""

import gc
import os
import pickle

import pytest

import checkpoints
import generate
from conftest import make_model
from model import GPTConfig


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):  # unpickling this would create the marker file
        return (open, (self.marker, "w"))


def test_a_pickle_posing_as_a_checkpoint_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "executed"
    directory = tmp_path / "ck"
    checkpoints.save(
        make_model(GPTConfig(n_layer=1, n_head=1, n_embd=8, vocab_size=20, n_positions=8)), directory
    )
    (directory / "model.safetensors").write_bytes(pickle.dumps(_Payload(str(marker))))
    with pytest.raises(checkpoints.CheckpointError, match="safetensors"):
        checkpoints.load(directory)
    (directory / "model.safetensors").unlink()
    (directory / "pytorch_model.bin").write_bytes(pickle.dumps(_Payload(str(marker))))
    with pytest.raises(checkpoints.CheckpointError, match="pickle, which gptgen never loads"):
        checkpoints.load(directory)
    assert not marker.exists()


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads RSS from Linux's /proc")
def test_two_hundred_sequential_requests_do_not_grow_memory():
    gen = generate.Generator(make_model(GPTConfig(n_layer=2, n_head=2, n_embd=32, n_positions=64), std=0.3))
    prompts = ["To be", "or not to be, that is", "", "the question"]
    for i in range(50):  # warm-up: allocator pools and caches reach their steady size
        gen.generate(prompts[i % 4], max_new_tokens=16, seed=i)
    gc.collect()
    start = rss_bytes()
    for i in range(200):
        if i % 10 == 0:
            gen.generate(prompts, max_new_tokens=16, seed=i, stop=["\n"])
        else:
            gen.generate(prompts[i % 4], max_new_tokens=16, temperature=0.8, top_p=0.9, seed=i)
    gc.collect()
    growth = rss_bytes() - start
    print(f"RSS before {start / 2**20:.1f} MiB, after 200 requests {(start + growth) / 2**20:.1f} MiB")
    # A request allocates ~1 MiB of vocabulary-sized state (logits, penalty counts): a leak of it would add
    # 200 MiB. The heap's fragmentation moves RSS by a few MiB either way; 16 MiB separates the two.
    assert growth < 16 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB over 200 requests"
