"""The JVM's start-up cost for the jobs' plain-python runs: C1-only JIT and a class-data-sharing archive.

Under plain python a job starts its own driver JVM (every executor of a local master lives in
it). Profiled on the 2-core machine the project is measured on, that JVM spent most of its
first 20 seconds not running Spark: C2 JIT compiler threads (19 s of CPU in a 50 s run) and
class loading, which searches the ~250 jars on Spark's classpath for each of ~20,000 classes.

- ``-XX:TieredStopAtLevel=1`` keeps the quick C1 compiler only: the JVM's hot loops run
  somewhat slower, which a local job (whose heavy work is TensorFlow's, in Python) does not feel.
- Class data sharing (JDK 13+ dynamic archives): the first run writes the classes it loaded to
  an archive under ``~/.cache/sparkdl/jvm`` when its JVM exits (``StartupOptions.finish``), and
  later runs map them instead of loading them. The archive is keyed by the Java binary and Spark's
  jars (so each virtualenv has its own); one unused for two weeks is removed when another is written.

Under spark-submit the JVM is started before the job runs: its options are spark-submit's
(``--driver-java-options``), and nothing here applies.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path

_log = logging.getLogger("sparkdl-job")
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sparkdl" / "jvm"
# The archive's own notices (classes it skips, a stale archive) are not the user's concern.
_QUIET_CDS = "-Xlog:cds=off -Xlog:cds+dynamic=off"
_EXIT_TIMEOUT = 120.0  # seconds for the JVM to write the archive and exit
_UNUSED_DAYS = 14  # an archive no run has used for this long is removed (each is about 170 MB)


class StartupOptions:
    """The driver JVM's start-up options, and the archive its exit writes when there is none yet."""

    def __init__(self) -> None:
        self.archive = _archive_path()
        self.writing: Path | None = None
        if self.archive is None:
            self.options = "-XX:TieredStopAtLevel=1"
        elif self.archive.exists():
            os.utime(self.archive)  # its time says when it was last used (see finish)
            self.options = f"-XX:TieredStopAtLevel=1 -XX:SharedArchiveFile={self.archive} {_QUIET_CDS}"
        else:
            self.writing = self.archive.with_name(f"{self.archive.stem}.{os.getpid()}.tmp")
            self.options = f"-XX:TieredStopAtLevel=1 -XX:ArchiveClassesAtExit={self.writing} {_QUIET_CDS}"

    def finish(self, spark_context_class) -> None:
        """After ``spark.stop()``: lets the JVM exit (writing the archive) and keeps the archive if it is whole."""
        if self.writing is None:
            return
        process = getattr(getattr(spark_context_class, "_gateway", None), "proc", None)
        if process is None or process.stdin is None:
            return
        _log.info("writing the JVM's class archive %s (once: later runs start faster)", self.archive)
        process.stdin.close()  # the gateway JVM exits when its stdin closes, writing the archive on the way out
        try:
            exited = process.wait(_EXIT_TIMEOUT)
        except Exception:  # noqa: BLE001 -- a slow exit only costs the archive
            exited = None
        if exited == 0 and self.writing.exists():
            os.replace(self.writing, self.archive)
            _remove_unused(self.archive)
        else:
            self.writing.unlink(missing_ok=True)


def _remove_unused(keep: Path) -> None:
    """Drops other archives (another Spark or Java, another virtualenv) that no run has used for a while."""
    cutoff = time.time() - _UNUSED_DAYS * 86400
    for other in CACHE.glob("spark-*.jsa"):
        with contextlib.suppress(OSError):
            if other != keep and other.stat().st_mtime < cutoff:
                other.unlink()


def _archive_path() -> Path | None:
    """``~/.cache/sparkdl/jvm/spark-<key>.jsa`` for this Java and these Spark jars; None where it cannot be kept."""
    java_home = os.environ.get("JAVA_HOME")
    java = shutil.which("java", path=os.path.join(java_home, "bin") if java_home else None)  # None: the PATH
    if java is None:
        return None
    import pyspark

    jars = sorted(glob.glob(os.path.join(os.path.dirname(pyspark.__file__), "jars", "*.jar")))
    key = hashlib.sha256(os.path.realpath(java).encode())
    for jar in jars:
        stat = os.stat(jar)
        key.update(f"{jar}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    try:
        CACHE.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return CACHE / f"spark-{key.hexdigest()[:16]}.jsa"
