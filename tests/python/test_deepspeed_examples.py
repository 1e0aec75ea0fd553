"""DeepSpeedExamples' training/cifar/cifar10_deepspeed.py on
strata.deepspeed, with only its `import deepspeed` line changed and its
dataset replaced by synthetic tensors of CIFAR's shapes (ds_examples_stubs/),
in bf16 and fp32 at stages 0-3, one rank and two ranks through
strata.launch.

The example's source is not in this repository: set
STRATA_DEEPSPEED_EXAMPLES to a checkout of
https://github.com/deepspeedai/DeepSpeedExamples to run these; without it
they are skipped, saying so.
"""

import os

import pytest

from launch_util import run_launch

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKOUT = os.environ.get("STRATA_DEEPSPEED_EXAMPLES")
SCRIPT = os.path.join(CHECKOUT or "", "training", "cifar", "cifar10_deepspeed.py")

pytestmark = pytest.mark.skipif(
    not CHECKOUT or not os.path.isfile(SCRIPT),
    reason="STRATA_DEEPSPEED_EXAMPLES does not name a DeepSpeedExamples checkout (the example's "
           "source stays out of this repository)")


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    with open(SCRIPT, "rb") as f:
        src = f.read()
    lines = src.split(b"\n")
    changed = [i for i, line in enumerate(lines) if line.rstrip(b"\r") == b"import deepspeed"]
    assert len(changed) == 1, "the example no longer has one `import deepspeed` line"
    lines[changed[0]] = lines[changed[0]].replace(b"import deepspeed",
                                                  b"import strata.deepspeed as deepspeed")
    out = tmp_path_factory.mktemp("cifar") / "cifar10_strata.py"
    out.write_bytes(b"\n".join(lines))
    return out


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_cifar_example_trains(script, dtype, stage, ranks, tmp_path):
    import strata
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(strata.__file__)))
    env = dict(os.environ, TMPDIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join([os.path.join(HERE, "ds_examples_stubs"),
                                           package_root]))
    env.pop("STRATA_GLOO_DIR", None)
    r = run_launch(["--nproc_per_node", str(ranks), str(script), "--dtype", dtype, "--stage",
                    str(stage), "--epochs", "1"], env, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout
    assert r.stdout.count("Finished Training") == ranks
    assert "Accuracy of the network on the 64 test images" in r.stdout
