"""Mixture-of-Experts layer over hetcomm."""
