"""A text file that fills the disk: for the tests of what a full disk does to a run's files."""
import errno


class FullDisk:
    """A text file whose ``k``-th flush writes half of what it holds, then fails as a full disk does."""

    def __init__(self, file, k):
        self.file, self.k, self.pending = file, k, ""

    def write(self, text):
        self.pending += text

    def flush(self):
        self.k -= 1
        if self.k == 0:
            self.file.write(self.pending[: len(self.pending) // 2])
            self.file.flush()
            raise OSError(errno.ENOSPC, "No space left on device")
        self.file.write(self.pending)
        self.file.flush()
        self.pending = ""

    def fileno(self):
        return self.file.fileno()

    def close(self):
        self.file.close()
