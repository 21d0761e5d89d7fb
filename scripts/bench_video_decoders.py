"""Which library decodes MP4 and WebM for load_video: time per frame and peak memory of each candidate.

    python scripts/bench_video_decoders.py --json decoders.json
    python scripts/bench_video_decoders.py --decoders pyav pyav-frame-threads --repeats 3

The clips are made here, with PyAV (the `video` extra), from seeded frames: a gradient that moves plus noise, as
H.264 in MP4 (libx264) and VP9 in WebM (libvpx-vp9), 64 frames of 224x224 and 300 frames of 640x360, 24 fps.
Each candidate decodes each clip to RGB frames held in memory (what load_video returns), in a process of its own
started for that one decode, so that its peak resident memory is its own: the table shows the peak (VmHWM, reset
through /proc/self/clear_refs after the imports) above the resident memory just before the decode. Before the
timed decode the child decodes the clip's first 2 frames once (untimed), so that the time is the steady state's,
not the first use of the codec's code and threads; "import s" is the library's import alone. Time and peak
are the median of --repeats runs. A candidate that does not install or import here is a row with its error.

Candidates:
  nanomm              load_video itself: PyAV (default threads: slices), one reused RGB converter, one copy into
                      Pillow, and the checks of nanomm/inputs/video_io.py
  pyav                PyAV as its docs show it: VideoFrame.to_image() per frame (a new converter each frame)
  pyav-frame-threads  nanomm's conversion with thread_type="AUTO" (frame and slice threads)
  torchcodec          torchcodec.decoders.VideoDecoder, every frame as one uint8 tensor
  opencv              cv2.VideoCapture (needs a file path), BGR frames converted to RGB
  imageio-ffmpeg      imageio_ffmpeg.read_frames: the ffmpeg binary its wheel ships, rgb24 through a pipe
Only PyAV is a nanomm dependency (the `video` extra): run the script where the others are installed too, e.g. a
virtual environment made with --system-site-packages plus `pip install opencv-python-headless imageio-ffmpeg
torchcodec`. Benchmarks are not tests: nothing asserts a timing. Lesson 17 quotes a run.
"""

import argparse
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DECODERS = ("nanomm", "pyav", "pyav-frame-threads", "torchcodec", "opencv", "imageio-ffmpeg")
CLIPS = {  # name: (container, codec, frames, width, height)
    "mp4-h264-64x224x224": ("mp4", "libx264", 64, 224, 224),
    "webm-vp9-64x224x224": ("webm", "libvpx-vp9", 64, 224, 224),
    "mp4-h264-300x640x360": ("mp4", "libx264", 300, 640, 360),
    "webm-vp9-300x640x360": ("webm", "libvpx-vp9", 300, 640, 360),
}
FPS = 24


def make_clip(path: Path, container: str, codec: str, frames: int, width: int, height: int, seed: int = 0):
    """Seeded frames (a moving gradient plus noise of +-12 levels) encoded with PyAV."""
    import av
    import numpy as np

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    options = {"deadline": "realtime", "cpu-used": "8"} if codec == "libvpx-vp9" else {"preset": "veryfast"}
    with av.open(str(path), "w", format=container) as out:
        stream = out.add_stream(codec, rate=FPS, options=options)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for t in range(frames):
            base = np.stack([(x + 3 * t) * 255 // width, (y + 2 * t) * 255 // height,
                             np.full_like(x, (5 * t) % 256)], axis=-1)
            frame = np.clip(base + rng.integers(-12, 13, base.shape), 0, 255).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


# --- one decode, in a child process ----------------------------------------------------------------------------

def memory_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def decoder(name: str):
    """(version, decode(path) -> list of RGB frames). Imports the library, so its import time is measured apart."""
    if name == "nanomm":
        import av

        from nanomm.inputs.video_io import load_video

        def decode(path, limit=None):
            if limit is not None:  # the warm-up: load_video takes the whole clip, so PyAV decodes its first frames
                with av.open(path) as container:
                    return [f.to_image() for f in itertools.islice(container.decode(video=0), limit)]
            return load_video(Path(path).read_bytes()).frames
        return f"av {av.__version__}", decode
    if name.startswith("pyav"):
        import io

        import av
        from av.video.reformatter import VideoReformatter
        from PIL import Image

        def decode(path, limit=None):
            with av.open(io.BytesIO(Path(path).read_bytes())) as container:  # nanomm decodes from bytes
                stream = container.streams.video[0]
                frames = itertools.islice(container.decode(stream), limit)
                if name == "pyav":
                    return [frame.to_image() for frame in frames]
                stream.thread_type = "AUTO"
                reformatter, images = VideoReformatter(), []
                for frame in frames:  # as nanomm/inputs/video_io.py's _frame_image does it
                    image = Image.new("RGB", (frame.width, frame.height))
                    plane = reformatter.reformat(frame, format="rgb24").planes[0]
                    image.frombytes(plane, "raw", ("RGB", plane.line_size, 1))
                    images.append(image)
                return images
        return av.__version__, decode
    if name == "torchcodec":
        import torchcodec
        from torchcodec.decoders import VideoDecoder

        def decode(path, limit=None):
            video = VideoDecoder(path)
            return video.get_frames_in_range(0, min(len(video), limit or len(video))).data  # (N, C, H, W) uint8
        return torchcodec.__version__, decode
    if name == "opencv":
        import cv2

        def decode(path, limit=None):
            capture, frames = cv2.VideoCapture(path), []
            while limit is None or len(frames) < limit:
                ok, frame = capture.read()
                if not ok:
                    break
                frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
            capture.release()
            return frames
        return cv2.__version__, decode
    if name == "imageio-ffmpeg":
        import imageio_ffmpeg

        def decode(path, limit=None):
            reader = imageio_ffmpeg.read_frames(path, pix_fmt="rgb24")
            next(reader)  # the metadata
            frames = list(itertools.islice(reader, limit))
            reader.close()  # stops the ffmpeg process
            return frames
        return imageio_ffmpeg.__version__, decode
    raise ValueError(name)


def child(name: str, path: str) -> dict:
    start = time.perf_counter()
    try:
        version, decode = decoder(name)
    except Exception as e:  # not installed, or its native library does not load against this torch
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
    import_s = time.perf_counter() - start
    decode(path, 2)  # warm-up: the codec's code paged in and its threads started, outside the timed decode
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux 4.0+)
    except OSError:
        pass
    rss = memory_kib("VmRSS")
    start = time.perf_counter()
    frames = decode(path)
    seconds = time.perf_counter() - start
    return {"version": version, "import_s": import_s, "seconds": seconds, "frames": len(frames),
            "peak_mib": (memory_kib("VmHWM") - rss) / 1024}


# --- the parent ------------------------------------------------------------------------------------------------

def run_child(name: str, path: Path) -> dict:
    run = subprocess.run([sys.executable, __file__, "--child", name, str(path)], capture_output=True, text=True,
                         timeout=600)
    if run.returncode != 0:
        return {"error": run.stderr.strip().splitlines()[-1][:200] if run.stderr.strip() else f"exit {run.returncode}"}
    return json.loads(run.stdout.strip().splitlines()[-1])


def machine() -> str:
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or "unknown CPU"
    return f"{cpu}, {os.cpu_count()} CPUs visible, Python {platform.python_version()}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decoders", nargs="+", default=list(DECODERS), choices=DECODERS)
    parser.add_argument("--clips", nargs="+", default=list(CLIPS), choices=list(CLIPS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, help="where the clips are written (default: a temporary folder)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--child", nargs=2, metavar=("DECODER", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="nanomm-decoders-"))
    workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    print(f"machine: {machine()}\n")
    print("| decoder | version | clip | MiB on disk | frames | ms per frame | peak MiB above start | RGB frames MiB "
          "| import s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for clip in args.clips:
        container, codec, frames, width, height = CLIPS[clip]
        path = workdir / f"{clip}.{container}"
        if not path.exists():
            make_clip(path, container, codec, frames, width, height)
        rgb_mib = frames * width * height * 3 / 2**20
        for name in args.decoders:
            runs = [run_child(name, path) for _ in range(args.repeats)]
            failed = next((r for r in runs if "error" in r), None)
            if failed:
                row = {"decoder": name, "clip": clip, "error": failed["error"]}
                print(f"| {name} | - | {clip} | {path.stat().st_size / 2**20:.2f} | - | fails: {failed['error']} "
                      "| | | |")
            else:
                row = {"decoder": name, "version": runs[0]["version"], "clip": clip, "frames": runs[0]["frames"],
                       "expected_frames": frames, "bytes": path.stat().st_size, "width": width, "height": height,
                       "ms_per_frame": statistics.median(r["seconds"] for r in runs) * 1000 / max(runs[0]["frames"], 1),
                       "peak_mib": statistics.median(r["peak_mib"] for r in runs), "rgb_mib": rgb_mib,
                       "import_s": statistics.median(r["import_s"] for r in runs), "runs": runs}
                print(f"| {name} | {row['version']} | {clip} | {row['bytes'] / 2**20:.2f} | {row['frames']} | "
                      f"{row['ms_per_frame']:.2f} | {row['peak_mib']:.0f} | {rgb_mib:.0f} | {row['import_s']:.2f} |")
            rows.append(row)
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "repeats": args.repeats, "fps": FPS, "rows": rows},
                                        indent=2) + "\n")
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
