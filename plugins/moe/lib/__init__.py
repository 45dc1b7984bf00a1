"""What the MoE backends share: expert placement and EPLB, two-batch overlap (not plugins: the registry skips lib/)."""
