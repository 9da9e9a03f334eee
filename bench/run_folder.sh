# Sourced (from the repository root) by bench/h200.sh and bench/peer_llamacpp/run_h200.sh: which commit a GPU run is
# of, and the folder its results go in. The device machine's tree is a copy whose `git rev-parse` is stale, so the
# coordinator writes the commit first (`git describe --always --dirty --abbrev=40 > bench/gpu_commit.txt`, untracked,
# not ignored: it travels with the tree). Exports FLASHRT_GIT_COMMIT (which every result JSON's provenance records)
# and sets RUN=<card>_<commit7>[-dirty] (card: the GPU's name without "NVIDIA", lower case; "cpu" without a GPU).
# Returns 2, with a message, when there is no commit.
if [ -z "${FLASHRT_GIT_COMMIT:-}" ]; then
  if [ ! -s bench/gpu_commit.txt ]; then
    echo "no commit: run 'git describe --always --dirty --abbrev=40 > bench/gpu_commit.txt' first" >&2
    return 2
  fi
  FLASHRT_GIT_COMMIT=$(head -n 1 bench/gpu_commit.txt | tr -d '[:space:]')
fi
export FLASHRT_GIT_COMMIT
run_card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | sed 's/^NVIDIA //' \
  | awk '{print tolower($1)}')
run_dirty=; [ "${FLASHRT_GIT_COMMIT%-dirty}" != "$FLASHRT_GIT_COMMIT" ] && run_dirty=-dirty
RUN=${run_card:-cpu}_${FLASHRT_GIT_COMMIT:0:7}$run_dirty
