"""What holds bytes: the expert cache and its host pack, the staging ring, the prompt workspace, and
the decode-only resources a loan may release."""
