"""`zdiag plan`: the wrap, prefetch and resharding choices searched with the what-if replay."""
