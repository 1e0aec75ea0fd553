"""DeepSpeedExamples' scripts on strata.deepspeed, with only their `import
deepspeed` line changed and their datasets replaced by synthetic tensors
(ds_examples_stubs/ stands in for torchvision):

- training/cifar/cifar10_deepspeed.py in bf16 and fp32 at stages 0-3, one
  rank and two ranks through strata.launch;
- training/pipeline_parallelism/train.py with `-p 0` (no pipeline: a plain
  AlexNet through deepspeed.initialize, its `--backend nccl` default, its
  RepeatingLoader) for one step of 32 micro-batches, and with `-p 2`
  refused naming deepspeed.pipe.PipelineModule;
- training/gan/gan_deepspeed_train.py (FakeData) where CUDA is: it puts its
  models and noise on `torch.device("cuda", local_rank)` unconditionally.

The examples' sources are not in this repository: set
STRATA_DEEPSPEED_EXAMPLES to a checkout of
https://github.com/deepspeedai/DeepSpeedExamples to run these; without it
they are skipped, saying so.
"""

import json
import os
import shutil

import pytest
import torch

from launch_util import run_launch

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKOUT = os.environ.get("STRATA_DEEPSPEED_EXAMPLES")
SCRIPT = os.path.join(CHECKOUT or "", "training", "cifar", "cifar10_deepspeed.py")

pytestmark = pytest.mark.skipif(
    not CHECKOUT or not os.path.isfile(SCRIPT),
    reason="STRATA_DEEPSPEED_EXAMPLES does not name a DeepSpeedExamples checkout (the example's "
           "source stays out of this repository)")


def changed_import(script, out_dir):
    """The example's directory copied into out_dir, its script's one
    `import deepspeed` line changed to strata.deepspeed's; the copy's path."""
    shutil.copytree(os.path.dirname(script), out_dir, dirs_exist_ok=True)
    with open(script, "rb") as f:
        lines = f.read().split(b"\n")
    changed = [i for i, line in enumerate(lines) if line.rstrip(b"\r") == b"import deepspeed"]
    assert len(changed) == 1, f"{script} no longer has one `import deepspeed` line"
    lines[changed[0]] = lines[changed[0]].replace(b"import deepspeed",
                                                  b"import strata.deepspeed as deepspeed")
    out = os.path.join(out_dir, os.path.basename(script))
    with open(out, "wb") as f:
        f.write(b"\n".join(lines))
    return out


def example_env(tmp_path):
    import strata
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(strata.__file__)))
    env = dict(os.environ, TMPDIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join([os.path.join(HERE, "ds_examples_stubs"),
                                           package_root]))
    env.pop("STRATA_GLOO_DIR", None)
    return env


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    return changed_import(SCRIPT, tmp_path_factory.mktemp("cifar"))


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_cifar_example_trains(script, dtype, stage, ranks, tmp_path):
    env = example_env(tmp_path)
    r = run_launch(["--nproc_per_node", str(ranks), str(script), "--dtype", dtype, "--stage",
                    str(stage), "--epochs", "1"], env, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout
    assert r.stdout.count("Finished Training") == ranks
    assert "Accuracy of the network on the 64 test images" in r.stdout


PIPELINE = os.path.join(CHECKOUT or "", "training", "pipeline_parallelism", "train.py")
GAN = os.path.join(CHECKOUT or "", "training", "gan", "gan_deepspeed_train.py")


def test_pipeline_example_without_a_pipeline_trains(tmp_path):
    """`-p 0`: AlexNet through deepspeed.initialize with training_data, one
    optimizer step (train_batch_size 256 of micro-batches of 8). Its
    ds_config.json as it is, plus ZeRO-Offload (stage 2, optimizer states on
    the CPU): without it the plan refuses, naming the HBM tier, since the
    host device models 1 GiB of HBM and 57M parameters with Adam need 1.1
    GiB there."""
    if not os.path.isfile(PIPELINE):
        pytest.skip(f"{PIPELINE} is not in the checkout")
    script = changed_import(PIPELINE, tmp_path / "pipeline")
    with open(os.path.join(os.path.dirname(PIPELINE), "ds_config.json")) as f:
        config = json.load(f)
    config["zero_optimization"] = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    (tmp_path / "ds_offload.json").write_text(json.dumps(config))
    r = run_launch(["--nproc_per_node", "1", script, "--deepspeed_config",
                    str(tmp_path / "ds_offload.json"), "-p", "0", "-s", "1"],
                   example_env(tmp_path), timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout
    # Its --backend nccl default, on a machine without CUDA: gloo, said once.
    if not torch.cuda.is_available():
        assert r.stdout.count("dist_backend 'nccl' asked for") == 1, r.stdout


def test_pipeline_example_with_a_pipeline_is_refused(tmp_path):
    if not os.path.isfile(PIPELINE):
        pytest.skip(f"{PIPELINE} is not in the checkout")
    script = changed_import(PIPELINE, tmp_path / "pipeline")
    r = run_launch(["--nproc_per_node", "1", script, "--deepspeed_config",
                    os.path.join(os.path.dirname(PIPELINE), "ds_config.json"), "-p", "2",
                    "-s", "1"], example_env(tmp_path), timeout=300, cwd=tmp_path)
    assert r.returncode != 0
    assert ("deepspeed.pipe.PipelineModule: pipeline parallelism is not supported"
            in r.stdout), r.stdout


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="the GAN example puts its models on torch.device('cuda', local_rank) "
                           "unconditionally: it needs CUDA")
def test_gan_example_trains(tmp_path):
    """Its own config (stage 0, Adam), torch.optim.Adam objects passed as
    optimizer=, two engines, netD.zero_grad() between them, 64 x 64
    FakeData images; one epoch (1000 images in batches of 64, its config's
    train_batch_size)."""
    if not os.path.isfile(GAN):
        pytest.skip(f"{GAN} is not in the checkout")
    try:
        import torch.utils.tensorboard  # noqa: F401  (the example's SummaryWriter)
    except ImportError as e:
        pytest.skip(f"the GAN example imports torch.utils.tensorboard: {e}")
    script = changed_import(GAN, tmp_path / "gan")
    config = tmp_path / "gan" / "gan_deepspeed_config.json"
    r = run_launch(["--nproc_per_node", "1", script, "--dataset", "fake", "--cuda",
                    "--batchSize", "64", "--workers", "0", "--epochs", "1",
                    "--deepspeed_config", str(config), "--outf", str(tmp_path / "out"),
                    "--tensorboard_path", str(tmp_path / "runs")],
                   example_env(tmp_path), timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout
    assert "Loss_D:" in r.stdout and "total wall clock time" in r.stdout, r.stdout
