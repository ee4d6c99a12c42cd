"""Native decode + transforms (clairvoyant._native.DecodePipeline, clairvoyant.torch.transforms)
against Pillow and torchvision on the same images.

Tolerances (docs/decode.md): PNG decode is exact; JPEG decode differs from Pillow's
libjpeg-turbo by a few levels (IDCT and chroma upsampling), checked as max abs <= JPEG_MAX and
mean abs <= JPEG_MEAN; resampling (Resize, RandomResizedCrop) is compared on PNG inputs with
max abs <= 2 (uint8; 3 for bicubic); crops, flips, conversion and Normalize are exact (float32 within 1e-6).
"""

from __future__ import annotations

import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tv = pytest.importorskip("torchvision")
from PIL import Image, ImageOps  # noqa: E402
from torchvision import transforms as T  # noqa: E402
from torchvision.transforms import functional as TF  # noqa: E402
from torchvision.transforms import v2  # noqa: E402

import clairvoyant  # noqa: E402
from clairvoyant import _native  # noqa: E402
from clairvoyant.torch import transforms as CT  # noqa: E402
from clairvoyant.torch._native_pipeline import BatchDecoder, native_plan  # noqa: E402

JPEG_MAX = 6
JPEG_MEAN = 0.5
RESAMPLE_MAX = 2
RESAMPLE_MAX_BICUBIC = 3  # bicubic overshoots; fixed-point rounding differs by one more level


def natural(w=500, h=375, seed=0) -> Image.Image:
    """A smooth image with texture, closer to a photo than noise (JPEG-friendly)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([128 + 100 * np.sin(x / 37 + c) * np.cos(y / 23 - c) for c in (0, 1, 2)], -1)
    noise = rng.normal(0, 12, (h // 4 + 1, w // 4 + 1, 3)).repeat(4, 0).repeat(4, 1)[:h, :w]
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8), "RGB")


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    b = io.BytesIO()
    img.save(b, fmt, **kw)
    return b.getvalue()


def pil_rgb(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def run(ops, data_list, output="uint8_hwc", mean=None, std=None, exif=False, samples=None, seed=0, epoch=0, names=None):
    p = _native.DecodePipeline(ops, output, mean, std, exif, 2)
    n = len(data_list)
    out = np.zeros((n, *p.sample_shape), dtype=np.float32 if output == "float32_chw" else np.uint8)
    p.run(data_list, samples if samples is not None else list(range(n)), seed, epoch, out, names)
    return out


def full(img_size):
    """A no-op geometric step fixing the output size: CenterCrop to the image's own size."""
    w, h = img_size
    return [("center_crop", h, w)]


def test_png_decodes_exactly_like_pillow_for_every_color_type():
    img = natural(61, 47)
    cases = {
        "rgb": img,
        "rgba": img.convert("RGBA"),
        "gray": img.convert("L"),
        "gray_alpha": img.convert("LA"),
        "palette": img.convert("P"),
    }
    for name, im in cases.items():
        data = encode(im, "PNG")
        got = run(full(im.size), [data])[0]
        np.testing.assert_array_equal(got, pil_rgb(data), err_msg=name)
    # A PNG with real transparency: alpha dropped without compositing, as convert("RGB").
    rgba = np.asarray(img.convert("RGBA")).copy()
    rgba[..., 3] = np.arange(61, dtype=np.uint8)[None, :] * 4
    data = encode(Image.fromarray(rgba, "RGBA"), "PNG")
    np.testing.assert_array_equal(run(full(img.size), [data])[0], rgba[..., :3])


@pytest.mark.parametrize("mode", ["RGB", "L", "CMYK"])
@pytest.mark.parametrize("subsampling", [0, 2])
def test_jpeg_decode_is_close_to_pillow(mode, subsampling):
    img = natural().convert(mode)
    data = encode(img, "JPEG", quality=90, subsampling=subsampling)
    got = run(full(img.size), [data])[0].astype(int)
    want = pil_rgb(data).astype(int)
    diff = np.abs(got - want)
    assert diff.max() <= JPEG_MAX and diff.mean() <= JPEG_MEAN, (mode, diff.max(), diff.mean())


def test_exif_orientation_off_by_default_as_image_folder_and_on_request():
    img = natural(80, 50)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    data = encode(img, "JPEG", quality=95, exif=exif.tobytes())
    stored = pil_rgb(data)
    got = run([("center_crop", 50, 80)], [data])[0]
    assert got.shape == stored.shape
    assert np.abs(got.astype(int) - stored).mean() <= JPEG_MEAN
    shown = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))
    assert shown.shape == (80, 50, 3)
    got = run([("center_crop", 80, 50)], [data], exif=True)[0]
    assert np.abs(got.astype(int) - shown).mean() <= JPEG_MEAN


def test_corrupt_and_truncated_inputs_raise_naming_the_sample():
    good = encode(natural(64, 48), "JPEG")
    bad = [good, good[: len(good) // 2], b"not an image", encode(natural(64, 48), "PNG")[:100]]
    ops = [("center_crop", 32, 32)]
    for k in (1, 2, 3):
        with pytest.raises(clairvoyant.CorruptError) as e:
            run(ops, [good, bad[k]], samples=[7, 40 + k], names=["a/ok.jpg", f"a/bad{k}.jpg"])
        assert f"a/bad{k}.jpg" in str(e.value) and f"sample {40 + k}" in str(e.value)


@pytest.mark.parametrize("interp", ["bilinear", "bicubic"])
@pytest.mark.parametrize("size", [224, 256, 600, (100, 333)])
def test_resize_matches_torchvision(interp, size):
    img = natural()
    data = encode(img, "PNG")
    mode = T.InterpolationMode(interp)
    want = np.asarray(T.Resize(size, interpolation=mode)(img))
    ops = [("resize", [size] if isinstance(size, int) else list(size), None, interp)]
    h, w = want.shape[:2]
    got = run(ops + [("center_crop", h, w)], [data])[0]
    assert got.shape == want.shape
    assert np.abs(got.astype(int) - want).max() <= (RESAMPLE_MAX if interp == "bilinear" else RESAMPLE_MAX_BICUBIC)


@pytest.mark.parametrize("size", [(224, 224), (375, 500), (400, 520), (101, 77)])
def test_center_crop_and_flip_match_torchvision_exactly(size):
    img = natural()
    data = encode(img, "PNG")
    want = np.asarray(T.RandomHorizontalFlip(1.0)(T.CenterCrop(size)(img)))
    got = run([("center_crop", *size), ("hflip", 1.0)], [data])[0]
    np.testing.assert_array_equal(got, want)
    got = run([("center_crop", *size), ("hflip", 0.0)], [data])[0]
    np.testing.assert_array_equal(got, np.asarray(T.CenterCrop(size)(img)))


def test_to_tensor_and_normalize_match_torchvision():
    img = natural()
    data = encode(img, "PNG")
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    want = T.Compose([T.CenterCrop(224), T.ToTensor(), T.Normalize(mean, std)])(img).numpy()
    got = run([("center_crop", 224, 224)], [data], "float32_chw", mean, std)[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    want = T.Compose([T.CenterCrop(224), T.PILToTensor()])(img).numpy()
    np.testing.assert_array_equal(run([("center_crop", 224, 224)], [data], "uint8_chw")[0], want)


def test_random_resized_crop_is_torchvision_given_its_parameters():
    img = natural()
    data = encode(img, "PNG")
    scale, ratio = (0.08, 1.0), (3 / 4, 4 / 3)
    ops = [("random_resized_crop", 224, 224, scale, ratio, "bilinear")]
    got = run(ops, [data] * 6, samples=list(range(6)), seed=11, epoch=2)
    for s in range(6):
        i, j, h, w = _native.random_resized_crop_params(500, 375, scale, ratio, 11, 2, s)
        want = np.asarray(TF.resized_crop(img, i, j, h, w, [224, 224], T.InterpolationMode.BILINEAR))
        assert np.abs(got[s].astype(int) - want).max() <= RESAMPLE_MAX, s


def test_random_resized_crop_parameters_follow_torchvision_distribution():
    scale, ratio = (0.08, 1.0), (3 / 4, 4 / 3)
    n = 4000
    ours = np.array([_native.random_resized_crop_params(500, 375, scale, ratio, 1, 0, s) for s in range(n)], float)
    torch.manual_seed(0)
    img = torch.zeros(3, 375, 500)
    theirs = np.array([T.RandomResizedCrop.get_params(img, list(scale), list(ratio)) for _ in range(n)], float)
    for name, p in (("ours", ours), ("torchvision", theirs)):
        assert (p[:, 0] + p[:, 2] <= 375).all() and (p[:, 1] + p[:, 3] <= 500).all(), name
    area = lambda p: p[:, 2] * p[:, 3] / (500 * 375)  # noqa: E731
    logr = lambda p: np.log(p[:, 3] / p[:, 2])  # noqa: E731
    center = lambda p: (p[:, 0] + p[:, 2] / 2) / 375  # noqa: E731
    for f, tol in ((area, 0.02), (logr, 0.02), (center, 0.02)):
        # Means and quartiles agree within sampling noise (n = 4000 each).
        assert abs(f(ours).mean() - f(theirs).mean()) <= tol
        assert np.abs(np.quantile(f(ours), [0.25, 0.5, 0.75]) - np.quantile(f(theirs), [0.25, 0.5, 0.75])).max() <= 2 * tol
    # Unreachable scale -> torchvision's center fallback clamped to the ratio.
    assert _native.random_resized_crop_params(1000, 10, (50.0, 60.0), ratio, 0, 0, 0) == (0, 493, 10, 13)


def test_random_augmentation_is_reproducible_per_seed_epoch_sample():
    data = encode(natural(), "JPEG", quality=90)
    ops = [("random_resized_crop", 64, 64, (0.08, 1.0), (3 / 4, 4 / 3), "bilinear"), ("hflip", 0.5)]
    a = run(ops, [data] * 4, samples=[0, 1, 2, 3], seed=5, epoch=1)
    np.testing.assert_array_equal(a, run(ops, [data] * 4, samples=[0, 1, 2, 3], seed=5, epoch=1))
    # Sample 2 alone, at another batch position, gets the same crop.
    np.testing.assert_array_equal(a[2], run(ops, [data], samples=[2], seed=5, epoch=1)[0])
    assert not np.array_equal(a, run(ops, [data] * 4, samples=[0, 1, 2, 3], seed=5, epoch=2))
    assert not np.array_equal(a[0], a[1])
    flips = [run([("center_crop", 8, 8), ("hflip", 0.5)], [encode(natural(9, 8), "PNG")], samples=[s])[0] for s in range(200)]
    n_flipped = sum(not np.array_equal(f, flips[0]) for f in flips)
    assert 60 <= n_flipped <= 140 or 60 <= 200 - n_flipped <= 140


def test_recogniser_maps_standard_pipelines_and_refuses_the_rest():
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    train = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(mean, std)])
    p = native_plan(train)
    assert p is not None and p.output == "float32_chw" and p.ops[0][0] == "random_resized_crop"
    assert p.ops[0][1:3] == (224, 224) and p.mean == tuple(mean)
    val = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), T.Normalize(mean, std)])
    assert native_plan(val).ops == (("resize", [256], None, "bilinear"), ("center_crop", 224, 224))
    v2train = v2.Compose(
        [
            v2.RandomResizedCrop(176, antialias=True),
            v2.RandomHorizontalFlip(),
            v2.ToImage(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(mean, std),
        ]
    )
    assert native_plan(v2train).output == "float32_chw"
    assert native_plan(v2.Compose([v2.CenterCrop(100), v2.PILToTensor()])).output == "uint8_chw"
    ours = CT.Compose([CT.RandomResizedCrop(224), CT.RandomHorizontalFlip(), CT.ToTensor(), CT.Normalize(mean, std)])
    assert native_plan(ours) == native_plan(train)

    class MyCrop(T.RandomResizedCrop):
        pass

    refused = [
        T.Compose([T.RandomResizedCrop(224), T.ColorJitter(0.4), T.ToTensor()]),
        T.Compose([T.RandomResizedCrop(224), T.Lambda(lambda x: x), T.ToTensor()]),
        T.Compose([MyCrop(224), T.ToTensor()]),
        T.Compose([T.Resize(256), T.ToTensor()]),  # no fixed size: samples would not collate
        T.Compose([T.RandomResizedCrop(224)]),  # ends in a PIL image
        T.Compose([T.ToTensor(), T.RandomResizedCrop(224)]),  # tensor resampling
        T.Compose([T.RandomResizedCrop(224, interpolation=T.InterpolationMode.NEAREST), T.ToTensor()]),
        v2.Compose([v2.RandomResizedCrop(224), v2.ToImage(), v2.ToDtype(torch.float32, scale=False)]),
        None,
    ]
    for t in refused:
        assert native_plan(t) is None, t


def test_native_pipeline_output_matches_torchvision_end_to_end():
    """The standard validation pipeline, through the recogniser, on PNG inputs."""
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    val = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), T.Normalize(mean, std)])
    imgs = [natural(500, 375, s) for s in range(3)] + [natural(300, 420, 9)]
    dec = BatchDecoder(native_plan(val), threads=2, pin_memory=False)
    got = dec.decode([encode(i, "PNG") for i in imgs], [0, 1, 2, 3]).numpy()
    want = np.stack([val(i).numpy() for i in imgs])
    # 2 uint8 levels of resampling difference, divided by std.
    assert np.abs(got - want).max() <= RESAMPLE_MAX / 255 / min(std) + 1e-5


def test_batch_decoder_reuses_a_bounded_ring_and_accepts_numpy_views():
    plan = native_plan(T.Compose([T.CenterCrop(16), T.PILToTensor()]))
    dec = BatchDecoder(plan, threads=1, pin_memory=False, depth=2)
    data = encode(natural(20, 20), "PNG")
    view = np.frombuffer(data, dtype=np.uint8)
    outs = [dec.decode([data, view], [0, 1]) for _ in range(3)]
    assert outs[0].data_ptr() == outs[2].data_ptr() != outs[1].data_ptr()
    assert torch.equal(outs[2][0], outs[2][1])
    with pytest.raises(ValueError):
        dec.decode([data], [0, 1])


def test_pinned_output_when_cuda_is_present():
    if not torch.cuda.is_available():
        pytest.skip("CUDA not available: pinned (page-locked) buffers need a CUDA runtime")
    plan = native_plan(T.Compose([T.CenterCrop(16), T.ToTensor()]))
    dec = BatchDecoder(plan, threads=1)
    out = dec.decode([encode(natural(20, 20), "PNG")], [0])
    assert out.is_pinned()
    assert torch.equal(out.to("cuda", non_blocking=True).cpu(), out)


# clairvoyant.torch.DataLoader's native path: tests/test_decode_dropin.py


def _use_in_child(pipe, data, q):
    out = np.zeros((1, *pipe.sample_shape), dtype=np.uint8)
    try:
        pipe.run([data], [0], 0, 0, out, None)
        q.put("ran")
    except clairvoyant.ConfigError as e:
        q.put(f"ConfigError: {e}")


def test_pipeline_used_after_fork_refuses_instead_of_hanging():
    import multiprocessing as mp

    data = encode(natural(20, 20), "PNG")
    pipe = _native.DecodePipeline([("center_crop", 8, 8)], "uint8_hwc", None, None, False, 2)
    out = np.zeros((1, *pipe.sample_shape), dtype=np.uint8)
    pipe.run([data], [0], 0, 0, out, None)  # the pool's threads exist in this process
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_use_in_child, args=(pipe, data, q))
    p.start()
    p.join(timeout=60)
    assert not p.is_alive(), "the forked child hung"
    got = q.get(timeout=5)
    assert got.startswith("ConfigError") and "fork" in got, got
