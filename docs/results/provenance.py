"""Where the records that lack a stamp came from, reconstructed from git: for each JSON record
under docs/results/ without all of its machine, jax version, commit and command (records made
before provenance.stamp() carried them), the commit that first added it, that commit's date
and the jax it pinned (requirements.txt then). The record ran with that commit's code or an
earlier one, and with that jax where it ran on this project's set-up; a GPU record names the
jax installed on the device instead (its own `jax` field, where it has one). The command is in
README.md's index.

  python docs/results/provenance.py > docs/results/provenance.md
"""
import json
import pathlib
import subprocess

RESULTS = pathlib.Path(__file__).resolve().parent
FIELDS = {"machine": ("cpu", "machine", "device", "device_kind", "processor", "gpu"), "jax": ("jax",),
          "commit": ("commit",), "command": ("command", "script")}
# Every lent GPU ran the jax installed on it, not the pin (docs/accelerators.md: "jax 0.11.2 (CUDA 13)").
DEVICE_JAX = "0.11.2, the device's"


def git(*args: str) -> str:
  return subprocess.run(["git", *args], cwd=RESULTS, capture_output=True, text=True, check=True).stdout.strip()


def lacking(record) -> list[str]:
  """The stamp's fields a record has nowhere at its top level."""
  if not isinstance(record, dict):
    return list(FIELDS)
  return [field for field, keys in FIELDS.items() if not any(record.get(k) for k in keys)]


def added(path: pathlib.Path) -> tuple[str, str, str]:
  """(commit, date, the jax pin) of the commit that first added `path` (following renames)."""
  commit, date = git("log", "--follow", "--diff-filter=A", "--format=%h %ad", "--date=short", "--",
                     str(path)).splitlines()[-1].split()
  pins = git("show", f"{commit}:requirements.txt").splitlines()
  jax = next((line.split("==")[1] for line in pins if line.startswith("jax==")), "not pinned")
  return commit, date, jax


def main() -> None:
  print("# Records without a whole stamp, and where they came from\n")
  print("Made by `python docs/results/provenance.py` (its docstring says how). A record added by a")
  print("commit ran with that commit's code or an earlier one. The machine of these CPU records was a")
  print("2-core x86 CPU whose model was not recorded (AMD EPYC or Intel Xeon); a GPU or TPU record")
  print("names its device in its own fields.\n")
  print("| record | lacks | added by | date | jax (the pin then; a GPU's own) |")
  print("|---|---|---|---|---|")
  for path in sorted(RESULTS.rglob("*.json")):
    missing = lacking(json.loads(path.read_text()))
    if missing:
      commit, date, jax = added(path)
      jax = DEVICE_JAX if "gpu" in path.name else jax
      print(f"| `{path.relative_to(RESULTS)}` | {', '.join(missing)} | {commit} | {date} | {jax} |")


if __name__ == "__main__":
  main()
