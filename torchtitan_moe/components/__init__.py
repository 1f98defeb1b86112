"""What a torchtitan TrainSpec is built from, above the MoE layer: the optimizer, metrics, data, and the
checks and monitors of the router and of training health."""
