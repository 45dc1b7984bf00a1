"""What the parallelism plugins share (not plugins: the registry skips lib/)."""
