"""Remove Identity and Dropout (inference mode) nodes."""
from maceq.quant.ir import Graph


def remove_identities(g: Graph) -> int:
    n_removed = 0
    for node in list(g.nodes):
        if node.op_type in ("Identity", "Dropout"):
            node.outputs = node.outputs[:1]  # Dropout's mask output is unused in inference
            g.bypass(node)
            n_removed += 1
    return n_removed
