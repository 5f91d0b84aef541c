"""English constituency parsing (paper section 6.3): treebank trees, linearisation, repair and EVALB scoring."""
