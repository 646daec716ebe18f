"""Token trees: `shapes` (chain, k-ary, Sequoia's DP, the DynamicTree spec), `dynamic` (growing an
EAGLE-2 tree with the draft, per row and round)."""
